"""``jaxllm generate``: text from a prompt, or rounds of a chat, through a cache."""
from __future__ import annotations

import sys

from ..policy import METHODS
from .common import (CliError, DEFAULT_MODEL, MODEL_HELP, add_policy_args, add_sampling_args,
                     add_weights_arg, flag_names, load, policy, read_text, sampling, seed_key,
                     streaming_cache)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text; several --prompt are rounds of one chat")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--prompt", action="append", default=[],
                   help="text to continue; repeat for several rounds sharing one cache; - reads "
                        "stdin")
    p.add_argument("--prompt-file", action="append", default=[],
                   help="a UTF-8 file whose text is a prompt (repeatable, after any --prompt)")
    add_sampling_args(p, max_new_tokens=64)
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a question to the model in its chat template; the "
                        "rounds share one cache, and each prints its answer and the cache's fill "
                        "(jaxllm chat is the interactive form)")
    # A cache that streams: generation runs past any fixed length.
    add_policy_args(p, methods=[m for m, c in METHODS.items() if c.keeps_cache and c.streams],
                    chunk=False)
    add_weights_arg(p, file_blocks=True)
    p.set_defaults(fn=cmd_generate)


def prompts(a) -> list[str]:
    """The prompts of --prompt (``-``: stdin) and --prompt-file, in that order."""
    out = [sys.stdin.read() if p == "-" else p for p in a.prompt]
    out += [read_text(path, "--prompt-file") for path in a.prompt_file]
    if not out:
        raise CliError("give a --prompt TEXT (- reads stdin) or a --prompt-file FILE")
    return out


def cmd_generate(a) -> None:
    import jax
    import jax.numpy as jnp

    from ..generate import generate
    texts = prompts(a)
    pc = policy(a)
    cfg, params, tok = load(a.model, weights=a.weights, keep_quantized=a.keep_quantized,
                            int8_inputs=a.int8_inputs,
                            file_blocks=True)
    sc = sampling(a, tok)
    cache, _ = streaming_cache(a, cfg, pc, len(tok.encode(texts[0])))
    key = seed_key(a.seed)
    if a.chat:
        _chat_rounds(a, texts, cfg, params, tok, cache, sc, key)
        return
    for i, prompt in enumerate(texts):  # each prompt is one round; the cache carries over
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


def _chat_rounds(a, texts, cfg, params, tok, cache, sc, key) -> None:
    from ..chat import Chat
    if not all(q.strip() for q in texts):
        raise CliError("--chat: a prompt is empty")
    try:
        c = Chat(params, cfg, tok, cache, sc, key)
    except ValueError as e:
        raise CliError(f"--chat: {flag_names(e)}; leave out --chat to continue the prompts as "
                       f"text") from None
    for q in texts:
        try:
            r = c.send(q)
        except ValueError as e:
            raise CliError(str(e)) from None
        print(f"> {r.question}\n{r.answer}\n  [{r.seen} tokens so far; the cache holds "
              f"{r.held} of {c.cache.capacity}: {r.kv_bytes / 2 ** 20:.2f} MiB of keys and "
              f"values; {r.tokens_per_s:.1f} tok/s]", flush=True)
