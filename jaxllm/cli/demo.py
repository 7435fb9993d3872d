"""``jaxllm demo``: the main job on the packaged model (make demo)."""
from __future__ import annotations

import os

import numpy as np

from ..argtypes import COUNT, SIZE
from .common import (CliError, add_kv_args, check_files, kv_quant, load, seed_int, sources)


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job on SmolLM2-135M: dense / window / "
                                    "StreamingLLM / recompute with a plot, then a streaming chat")
    p.add_argument("--model", action="append", default=None,
                   help="LABEL=MODEL or MODEL, repeatable (default: SmolLM2-135M=smollm2; the "
                        "models trained here: embedded, embedded-sink)")
    p.add_argument("--tokens", type=COUNT, default=4096, help="stream length")
    p.add_argument("--cache", type=COUNT, default=256, help="W: sinks + window")
    p.add_argument("--sinks", type=SIZE, default=4,
                   help="sink tokens of the StreamingLLM and recompute rows")
    p.add_argument("--positions", type=COUNT, default=64,
                   help="recompute is scored at this many seeded positions past the first W")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the sampled positions")
    p.add_argument("--int8", action="store_true",
                   help="also StreamingLLM on a SmoothQuant W8A8 O1 copy")
    p.add_argument("--chat-cache", type=COUNT, default=160,
                   help="sinks + window of the chat's cache (the rounds together overflow it)")
    p.add_argument("--out", default="demo_out", help="directory for demo.json and demo.png")
    add_kv_args(p)
    p.set_defaults(fn=cmd_demo)


def cmd_demo(a) -> None:
    import time

    from ..corpus import builtin_corpus
    from ..demo import (DemoConfig, explain, explain_chats, format_table, run_chats, run_demo,
                        write_result)
    t0 = time.perf_counter()
    for flag, v in (("--tokens", a.tokens), ("--positions", a.positions)):
        if v < 1:
            raise CliError(f"{flag} must be >= 1, got {v}")
    dc = DemoConfig(tokens=a.tokens, cache=a.cache, sinks=a.sinks, positions=a.positions,
                    seed=a.seed, int8=a.int8, kv_quant=kv_quant(a), chat_cache=a.chat_cache)
    if dc.cache <= dc.sinks or dc.chat_cache <= dc.sinks:
        raise CliError(f"--cache {dc.cache} and --chat-cache {dc.chat_cache} must exceed "
                       f"--sinks {dc.sinks}")
    if dc.tokens <= dc.cache + 1:
        raise CliError(f"--tokens {dc.tokens} must exceed --cache {dc.cache} + 1: the window "
                       f"must slide for the methods to differ")
    specs = [spec.partition("=") for spec in a.model or ["SmolLM2-135M=smollm2"]]
    srcs = [p for label, sep, path in specs for p in sources(path if sep else label)]
    check_files({f"--out ({name})": os.path.join(a.out, name)
                 for name in ("demo.json", "demo.png")}, srcs)
    models = {}
    for label, sep, path in specs:
        models[label] = load(path if sep else label)
    tok = next(iter(models.values()))[2]
    ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
    if len(ids) < 2 * dc.tokens:
        raise CliError(f"--tokens {dc.tokens}: the corpus has {len(ids)} tokens; use at most "
                       f"{len(ids) // 2} (the rest calibrates INT8)")
    # The stream is the corpus' first tokens; INT8 calibrates on its second half.
    res = run_demo(models, ids[:dc.tokens], ids[len(ids) // 2:], dc, a.out)
    # Written before the chat: an interrupted or failed chat leaves the scoring's results.
    res["wall_s"] = round(time.perf_counter() - t0, 1)  # loading, compiling and scoring
    write_result(res, a.out)
    print("\n" + format_table(res))
    print("\n" + explain(res))
    print(f"\nwrote {a.out}/demo.json and {a.out}/demo.png ({res['wall_s']:.0f} s)", flush=True)
    run_chats(models, dc, res)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(res, a.out)
    chats = explain_chats(res)
    if chats:
        print("\n" + chats)
    for label, text in res["generations"].items():
        print(f"\n[{label}, {dc.generation_policy.label}] >>> {dc.prompt}{text}")
    print(f"\nadded the chat to {a.out}/demo.json ({res['wall_s']:.0f} s in all)")
    print("next: jaxllm chat (a conversation of your own), jaxllm ppl --text FILE (your text)")
