"""``jaxllm generate``: text from a prompt, or rounds of a chat, through a cache."""
from __future__ import annotations

import sys


from ..argtypes import COUNT, SIZE, real
from ..policy import METHODS, Dense
from .common import (CliError, DEFAULT_MODEL, MODEL_HELP, add_policy_args, add_weights_arg,
                     check_streamable, flag_names, load, policy, seed_int)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text; several --prompt are rounds of one chat")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--prompt", action="append", required=True,
                   help="text to continue; repeat for several rounds sharing one cache")
    p.add_argument("--max-new-tokens", type=COUNT, default=64, help="tokens generated per prompt")
    p.add_argument("--temperature", type=real(0.0), default=0.0,
                   help="sampling temperature; 0 is greedy decoding")
    p.add_argument("--top-k", type=SIZE, default=0,
                   help="sample from the k most likely tokens only (0: no limit)")
    p.add_argument("--top-p", type=real(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed for sampling")
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is a question to the model in its chat template; the "
                        "rounds share one cache, and each prints its answer and the cache's fill")
    # A cache that streams: generation runs past any fixed length.
    add_policy_args(p, methods=[m for m, c in METHODS.items() if c.keeps_cache and c.streams],
                    chunk=False)
    add_weights_arg(p)
    p.set_defaults(fn=cmd_generate)


def cmd_generate(a) -> None:
    import jax
    import jax.numpy as jnp

    from ..generate import SamplingConfig, generate
    from ..positions import can_stream
    pc = policy(a)
    cfg, params, tok = load(a.model, weights=a.weights, keep_quantized=a.keep_quantized)
    try:
        sc = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            top_k=a.top_k, top_p=a.top_p, eos_id=tok.eos_id)
        if not can_stream(cfg):
            if a.method != "streaming":
                check_streamable(cfg, pc)  # position rolling needs RoPE or ALiBi: refuse
            print(f"note: {cfg.family} cannot stream; using a dense cache of {pc.cache} tokens",
                  file=sys.stderr)
            slots, pc = pc.cache, Dense(pc.storage)
        else:
            # Fractional budgets are of the (first) prompt, as the authors' ratio of its length.
            pc = pc.resolve(len(tok.encode(a.prompt[0])))
            slots = pc.cache
        pc.check(cfg, slots)
        cache = pc.make_cache(cfg, 1, slots)
    except ValueError as e:
        raise CliError(flag_names(e)) from None
    key = jax.random.key(a.seed)
    if a.chat:
        _chat_rounds(a, cfg, params, tok, cache, sc, key)
        return
    for i, prompt in enumerate(a.prompt):  # each prompt is one round; the cache carries over
        ids = tok.encode(prompt)
        if not ids:
            raise CliError(f"prompt {i + 1} is empty")
        key, sub = jax.random.split(key)
        try:
            res = generate(params, cfg, jnp.asarray([ids]), cache, sc, sub)
        except ValueError as e:
            raise CliError(str(e)) from None
        cache = res.cache
        n = int(res.num_tokens[0])
        # The prompt and its continuation as one text; rounds apart by a blank line.
        print(("\n" if i else "") + prompt + tok.decode(list(res.tokens[0, :n])), flush=True)


def _chat_rounds(a, cfg, params, tok, cache, sc, key) -> None:
    from ..chat import chat
    if not getattr(tok, "has_chat_template", False):
        raise CliError(f"--chat: {a.model}'s tokenizer has no chat template (a base or "
                       f"byte-level model); leave out --chat to continue the prompts as text")
    if not all(q.strip() for q in a.prompt):
        raise CliError("--chat: a --prompt is empty")

    def show(r):
        print(f"> {r.question}\n{r.answer}\n  [{r.seen} tokens so far; the cache holds "
              f"{r.held} of {cache.capacity}: {r.kv_bytes / 2 ** 20:.2f} MiB of keys and "
              f"values]", flush=True)
    try:
        chat(params, cfg, tok, a.prompt, cache, sc, key, on_round=show)
    except ValueError as e:
        raise CliError(str(e)) from None
