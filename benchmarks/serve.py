"""Continuous batching on the real model: the serving engine (jaxllm.serve.engine) with N
streams answering at once, against the same requests one at a time.

SmolLM2 (the packaged GGUF; the file's 4-bit blocks unless --float), a pool of --slots rows of
a StreamingLLM cache, greedy answers of --tokens tokens to N different prompts submitted
together; the engine driven in this process (no HTTP), compiled programs warmed first. Per N:
the wall time until all are answered, tokens/s over all streams, the mean time per decode step
and the time to first token. The answers are checked equal to the one-at-a-time ones.

    python benchmarks/serve.py [--streams 1,2,4,8] [--tokens 64] [--slots 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import record  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.serve import Engine, Request, Sampling  # noqa: E402

PROMPTS = ["Tell me about the ocean.", "What is a prime number?", "Describe a forest at dawn.",
           "How do airplanes fly?", "Write a short poem about rain.", "What is gravity?",
           "Explain what a computer does.", "Why is the sky blue?"]


def serve(engine: Engine, prompts: list, tokens: int) -> tuple[list, float, list]:
    """(answers, seconds until all are done, each request's time to first token)."""
    done = {}
    reqs = []
    for k, p in enumerate(prompts):
        def emit(ev, k=k):
            assert ev[0] != "error", ev
            if ev[0] == "done":
                done[k] = ev[1]
        reqs.append(Request(messages=[{"role": "user", "content": p}],
                            sampling=Sampling(max_tokens=tokens), emit=emit))
    steps0 = engine.stats["steps"]
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    while len(done) < len(reqs):
        engine.iterate()
    secs = time.perf_counter() - t0
    res = [done[k] for k in range(len(reqs))]
    return res, secs, [r.first_token_seconds for r in res], engine.stats["steps"] - steps0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--float", action="store_true", help="float32 weights (default: the "
                                                         "file's 4-bit blocks)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    cfg, params, tok = jaxllm.load_model("smollm2", keep_quantized=not a.float)
    engine = Engine(params, cfg, tok, jaxllm.StreamingLLM(4, a.cache), slots=a.slots)
    engine.warm_up()
    counts = [int(x) for x in a.streams.split(",")]
    alone = [serve(engine, [p], a.tokens)[0][0] for p in PROMPTS[:max(counts)]]
    lines = ["| streams | answers | tokens | wall s | tokens/s | ms per step | first token s "
             "(mean) | same as alone |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n in counts:
        res, secs, first, steps = serve(engine, PROMPTS[:n], a.tokens)
        toks = sum(r.completion_tokens for r in res)
        same = all(r.token_ids == b.token_ids for r, b in zip(res, alone))
        lines.append(f"| {n} | {len(res)} | {toks} | {secs:.2f} | {toks / secs:.1f} | "
                     f"{1e3 * secs / max(steps, 1):.1f} | {np.mean(first):.2f} | "
                     f"{'yes' if same else 'NO'} |")
        print(lines[-1], flush=True)
    weights = "float32" if a.float else "the file's 4-bit blocks (Q4_1, Q8_0 embedding)"
    record(f"Serving: concurrent streams (SmolLM2, {'float32' if a.float else '4-bit'})",
           "\n".join(lines),
           f"jaxllm.serve.Engine in one process, {a.slots} rows of StreamingLLM 4+{a.cache - 4}, "
           f"weights {weights}; greedy chat answers of up to {a.tokens} tokens to different "
           f"questions submitted together. 'ms per step' is the wall time over decode steps "
           f"(prompt chunks included); 'same as alone': every answer's tokens equal the same "
           f"request served by itself.", dry=a.no_record)


if __name__ == "__main__":
    main()
