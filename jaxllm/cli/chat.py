"""``jaxllm chat``: an interactive, multi-turn chat through a StreamingLLM cache.

At a terminal: a prompt, the answer printed as it is generated, its tokens/s after it, and the
commands /reset, /cache, /help and /exit (or Ctrl-D). Otherwise each line of stdin is one
message, and each answer is printed after a line naming the message.
"""
from __future__ import annotations

import os
import sys

from ..argtypes import COUNT
from ..chat import BURST, CHUNK
from ..policy import METHODS
from .common import (DEFAULT_MODEL, MODEL_HELP, CliError, add_policy_args, add_sampling_args,
                     add_weights_arg, flag_names, load, policy, sampling, seed_key,
                     streaming_cache)

HELP = ("/reset  start a new conversation (an empty cache)\n"
        "/cache  what the cache holds\n"
        "/exit   leave (or Ctrl-D)")


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="an interactive chat with the model, through a StreamingLLM "
                                    "cache that keeps the whole conversation at fixed memory")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--system", default=None,
                   help="a system message before the conversation (default: the template's)")
    p.add_argument("--stop", action="append", default=[],
                   help="end an answer where this text appears (repeatable)")
    add_sampling_args(p, max_new_tokens=256)
    p.add_argument("--chunk", type=COUNT, default=CHUNK,
                   help=f"prompt tokens per feed call (default {CHUNK}: a chat's turns are short; "
                        f"64 feeds long pasted prompts faster and short turns slower)")
    p.add_argument("--burst", type=COUNT, default=BURST,
                   help=f"answer tokens generated per call, the text shown a burst at a time "
                        f"(default {BURST}; 1 shows each token as it comes, and is slower)")
    p.add_argument("--show-cache", action="store_true",
                   help="after each answer, also print what the cache holds")
    # A float16 cache, as llama.cpp's: half the bytes (22 MiB of SmolLM2's peak) and the same
    # answers to the token in the measured chats (docs/CPU.md, "A chat's answer").
    add_policy_args(p, methods=[m for m, c in METHODS.items() if c.keeps_cache and c.streams],
                    chunk=False, kv_dtype="float16")
    add_weights_arg(p, file_blocks=True)
    p.set_defaults(fn=cmd_chat)


def cmd_chat(a) -> None:
    import jax

    from ..chat import Chat
    from ..progress import one_malloc_arena, return_freed_memory
    one_malloc_arena()  # before JAX starts its threads
    pc = policy(a)
    tty = sys.stdin.isatty()
    how = dict(weights=a.weights, keep_quantized=a.keep_quantized, int8_inputs=a.int8_inputs,
               file_blocks=True)

    def make(cfg, params, tok, cache, answer=None):
        try:
            return Chat(params, cfg, tok, cache, sampling(a, tok), seed_key(a.seed),
                        system=a.system, stop=a.stop, chunk=a.chunk, burst=a.burst,
                        answer=answer)
        except ValueError as e:
            raise CliError(f"{a.model}: {flag_names(e)}; use jaxllm generate to continue text")

    # The answer's program first, from the weights' shapes, then the weights: its load's
    # transient over less memory (docs/CPU.md, "Peak memory"). At a terminal the rest of a
    # turn's programs load in the background after them, while the user types.
    cache = answer = loaded = None
    again = False
    shaped = load(a.model, shapes_only=True, **how)
    if shaped is None:  # a GGUF file's first load converts it: the shapes are there after it
        loaded = load(a.model, **how)
        shaped = load(a.model, shapes_only=True, **how)
        if shaped is not None:  # compiled without the weights in memory, then read again
            loaded, again = None, True
            return_freed_memory()
    if shaped is not None:
        cache, capacity = streaming_cache(a, shaped[0], pc)
        answer = make(*shaped, cache).compile_answer()
        del shaped
        # The program is held; what JAX's caches kept of its tracing and lowering (8 MiB for
        # SmolLM2) is not needed again.
        jax.clear_caches()
        return_freed_memory()
    cfg, params, tok = loaded or load(a.model, again=again, **how)
    del loaded
    if cache is None:
        cache, capacity = streaming_cache(a, cfg, pc)
    c = make(cfg, params, tok, cache, answer)
    if tty:
        c.warm_up()  # while the user types the first question
        print(f"Chatting with {a.model} through a {pc.label} cache of {capacity} tokens. "
              f"/help for commands, Ctrl-D to leave.", file=sys.stderr)
    for line in _lines(tty):
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/help":
            print(HELP, file=sys.stderr)
            continue
        if text == "/reset":
            c.reset()
            print("(a new conversation)", file=sys.stderr)
            continue
        if text == "/cache":
            print(_cache_line(c, capacity), file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP.replace(chr(10), ', ')}",
                  file=sys.stderr)
            continue
        if not tty:
            print(f">>> {text}", flush=True)
        try:
            r = c.send(text, on_text=lambda piece: print(piece, end="", flush=True))
        except ValueError as e:
            raise CliError(flag_names(e)) from None
        print(flush=True)
        return_freed_memory()  # the turn's freed temporaries: glibc would keep them resident
        note = {"length": f", cut at --max-new-tokens {a.max_new_tokens}",
                "stop string": ", ended at a stop string",
                "interrupted": ", interrupted"}.get(r.stopped_by, "")
        print(f"[{r.answer_tokens} tokens, {r.tokens_per_s:.1f} tok/s{note}]"
              + (f" {_cache_line(c, capacity)}" if a.show_cache else ""), file=sys.stderr)
    if c.warming:  # left before the background compile ended: neither wait for it nor let
        sys.stdout.flush()  # the interpreter's exit tear XLA down under it (an abort)
        sys.stderr.flush()
        os._exit(0)


def _cache_line(c, capacity: int) -> str:
    from ..kv.cache import kv_bytes
    return (f"[the conversation has fed {c.seen} tokens; the cache holds {c.held} of "
            f"{capacity}: {kv_bytes(c.cache) / 2 ** 20:.2f} MiB of keys and values]")


def _lines(tty: bool):
    """The user's messages: typed at a prompt (with line editing) or read from stdin."""
    if not tty:
        yield from sys.stdin
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            yield input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as a shell does
            print(file=sys.stderr)
