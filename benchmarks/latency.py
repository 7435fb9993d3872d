"""Per-token decode latency and memory against cache size (StreamingLLM Fig. 10):
StreamingLLM (4 sinks + window), a dense cache of the same size, and sliding window with
re-computation (a fresh forward over the last L tokens for every token).

Each cache size runs in a fresh process; within it the three methods' timed rounds alternate.
Prints a table, writes bench_out/latency.{json,png} and appends the table to docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _record import record  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "bench_out")


def measure(model: str, L: int, tokens: int, recompute_tokens: int, rounds: int,
            dtype: str = "float32") -> list[dict]:
    """ms per decoded token with L slots for the three methods, their rounds interleaved (this
    host is shared: whatever slows one round slows the others' neighbouring rounds too), each
    method's best round reported; and the memory one step needs (XLA's accounting of the
    compiled step: weights + KV cache + scratch)."""
    import jax
    import jax.numpy as jnp

    import jaxllm
    from jaxllm.model import apply
    from jaxllm.policy import Dense, StreamingLLM
    cfg, params, _ = jaxllm.load_model(model)
    if dtype == "bfloat16":  # weights, compute and KV cache in bfloat16
        import dataclasses
        cfg = dataclasses.replace(cfg, dtype="bfloat16")
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    cache_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    tok, lens = jnp.ones((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    recompute = jax.jit(lambda p, w: apply(p, cfg, w)[0][:, -1])
    window = jnp.ones((1, L), jnp.int32)

    def filled(cache, n):  # 256-token chunks: no [L, L] prefill in the way
        for i in range(0, n, 256):
            _, cache = jaxllm.forward(params, cfg, jnp.ones((1, min(256, n - i)), jnp.int32),
                                      cache)
        return cache

    # streaming: a full 4 + (L - 4) ring, as after a long stream; dense: filled so that the
    # warm-up and every round decode within its L slots.
    state = {"streaming": filled(StreamingLLM(4, L).make_cache(cfg, 1, 0, cache_dtype),
                                 L),
             "dense": filled(Dense().make_cache(cfg, 1, L, cache_dtype),
                             L - (rounds + 1) * tokens - 1),
             "recompute": None}
    memory = {m: step.lower(params, tokens=tok, cache=state[m], lens=lens).compile()
              for m in ("streaming", "dense")}
    memory["recompute"] = recompute.lower(params, window).compile()
    memory = {m: (c.memory_analysis().argument_size_in_bytes
                  + c.memory_analysis().temp_size_in_bytes) / 2**20 for m, c in memory.items()}

    def run(method, cache):
        if method == "recompute":
            for _ in range(recompute_tokens):
                out = recompute(params, window)
        else:
            for _ in range(tokens):
                out, cache = step(params, tokens=tok, cache=cache, lens=lens)
        out.block_until_ready()
        return cache

    times = {m: [] for m in state}
    for r in range(rounds + 1):  # round 0 compiles
        for m in state:
            t0 = time.perf_counter()
            state[m] = run(m, state[m])
            if r:
                n = recompute_tokens if m == "recompute" else tokens
                times[m].append((time.perf_counter() - t0) / n * 1e3)
    return [{"method": m, "cache": L, "ms_per_token": min(times[m]),
             "ms_per_token_median": sorted(times[m])[len(times[m]) // 2],
             "step_memory_mib": memory[m]} for m in state]


def plot(rows, path, title):
    from jaxllm.plots import figure
    with figure(path, title, size=(9, 3.4), ncols=2, data=rows) as (a1, a2):
        for method in ("recompute", "dense", "streaming"):
            r = [x for x in rows if x["method"] == method]
            a1.plot([x["cache"] for x in r], [x["ms_per_token"] for x in r], marker="o",
                    label=method)
            a2.plot([x["cache"] for x in r], [x["step_memory_mib"] for x in r], marker="o",
                    label=method)
        a1.set_yscale("log")
        a1.set_ylabel("ms per token")
        a2.set_ylabel("step memory (MiB)")
        for a in (a1, a2):
            a.set_xlabel("cache size (tokens)")
            a.set_xscale("log", base=2)
            a.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:pythia-14m")
    ap.add_argument("--sizes", default="256,512,1024,2048,4096")
    ap.add_argument("--tokens", type=int, default=32,
                    help="decode steps per timed round (cached methods)")
    ap.add_argument("--recompute-tokens", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds; the best is reported")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights, compute and KV cache")
    ap.add_argument("--one", type=int, metavar="L", help=argparse.SUPPRESS)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.model, a.one, a.tokens, a.recompute_tokens, a.rounds,
                                 a.dtype)))
        return
    rows = []
    for L in [int(x) for x in a.sizes.split(",")]:  # a fresh process per cache size
        out = subprocess.run([sys.executable, __file__, "--model", a.model, "--tokens",
                              str(a.tokens), "--recompute-tokens", str(a.recompute_tokens),
                              "--rounds", str(a.rounds), "--dtype", a.dtype, "--one", str(L)],
                             check=True,
                             capture_output=True, text=True).stdout
        rows.extend(json.loads(out.strip().splitlines()[-1]))
        for r in rows[-3:]:
            print(r, flush=True)
    lines = ["| cache | StreamingLLM ms/tok | dense ms/tok | recompute ms/tok | "
             "recompute / StreamingLLM | StreamingLLM / dense | step memory MiB (S / D / R) |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    by = {(r["method"], r["cache"]): r for r in rows}
    sizes = sorted({r["cache"] for r in rows})
    for L in sizes:
        s, d, r = by["streaming", L], by["dense", L], by["recompute", L]
        lines.append(f"| {L} | {s['ms_per_token']:.2f} | {d['ms_per_token']:.2f} | "
                     f"{r['ms_per_token']:.1f} | {r['ms_per_token'] / s['ms_per_token']:.1f}x | "
                     f"{s['ms_per_token'] / d['ms_per_token']:.2f}x | {s['step_memory_mib']:.1f} / "
                     f"{d['step_memory_mib']:.1f} / {r['step_memory_mib']:.1f} |")
    top = max(sizes)
    speed = by["recompute", top]["ms_per_token"] / by["streaming", top]["ms_per_token"]
    vs_dense = by["streaming", top]["ms_per_token"] / by["dense", top]["ms_per_token"]
    med = by["streaming", top]["ms_per_token_median"] / by["dense", top]["ms_per_token_median"]
    notes = (f"Model {a.model}, {a.dtype}, batch 1. ms/token: the best of {a.rounds} rounds of {a.tokens} "
             f"steps ({a.recompute_tokens} for recompute), the three methods' rounds interleaved "
             f"in one process per cache size (medians in bench_out/latency.json). Step memory: "
             f"XLA's accounting of the compiled step (weights + KV cache + scratch). At cache "
             f"{top}: StreamingLLM is {speed:.1f}x faster per token than recompute (target "
             f">= 22.2x: {'met' if speed >= 22.2 else 'NOT met'}) "
             f"and {vs_dense:.2f}x the dense cache's time (target <= 1.15x: "
             f"{'met' if vs_dense <= 1.15 else 'NOT met'}; medians {med:.2f}x).")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "latency.json"), "w") as f:
        json.dump({"model": a.model, "rows": rows}, f, indent=2)
    plot(rows, os.path.join(OUT, "latency.png"), f"{a.model}: decode latency and memory")
    table = "\n".join(lines)
    record("Decode latency vs cache size: StreamingLLM, dense, recompute", table, notes,
           dry=a.no_record)


if __name__ == "__main__":
    main()
