"""Float32 decode with the kernels stored [in, out] (the model's layout) against [out, in]
(``quant.decode_weights(params, "float32")``, the layout of W8), Pythia-160M shapes, random
weights, StreamingLLM 4+252.

Why: a one-row product that contracts the weight's minor axis (``W @ x``, [out, in]) reads
memory faster on XLA:CPU than one that contracts its major axis (``x @ W``, [in, out]). The
[out, in] model here is the float32 weights as weight-only nodes (``QKernel`` with a float32
``q`` and a scale of 1, which ``weight_only.weight_only_matmul`` reads as stored); both compute the
same products in float32. The two layouts' rounds alternate in one process; the read ceiling
is the roofline's (weights + KV bytes).

    python benchmarks/f32_layout.py
    python benchmarks/f32_layout.py --preset llama2-7b --layers 2     # 4,096-wide layers
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import full_ring, read_ceiling_ms, record, steady_heap, time_decode  # noqa: E402

import jax  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.model import apply  # noqa: E402
from jaxllm.policy import StreamingLLM  # noqa: E402
from jaxllm.quant import decode_weights  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="pythia-160m")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of 10 steps (median)")
    ap.add_argument("--layers", type=int, default=0,
                    help="keep only this many layers (0: all; a wide preset's shapes, in memory)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    cfg = jaxllm.PRESETS[a.preset]
    if a.layers:
        cfg = dataclasses.replace(cfg, num_layers=a.layers)
    p_io = jaxllm.init_params(cfg, jax.random.key(0))
    models = {"[in, out]": p_io, "[out, in]": decode_weights(p_io, "float32")}
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    policy = StreamingLLM(4, 256)
    wbytes = sum(x.nbytes for x in jax.tree.leaves({k: v for k, v in p_io.items()
                                                    if k != "embed" or cfg.tie_embeddings}))
    lines = ["| batch | kernels | ms/step | speed | read ceiling (ms) | of ceiling |",
             "|---:|---|---:|---:|---:|---:|"]
    for B in [int(b) for b in a.batch.split(",")]:
        caches = {n: full_ring(policy.make_cache(cfg, B, 0)) for n in models}
        times = {n: [] for n in models}
        for r in range(a.rounds + 1):  # round 0 compiles and warms up
            for n, p in models.items():
                ms, caches[n] = time_decode(step, p, caches[n], 10, warmup=1)
                if r:
                    times[n].append(ms)
        kv = sum(x.nbytes for x in jax.tree.leaves((caches["[in, out]"].k,
                                                    caches["[in, out]"].v)))
        ceil = read_ceiling_ms(wbytes + kv)
        base = float(np.median(times["[in, out]"]))
        for n in models:
            ms = float(np.median(times[n]))
            lines.append(f"| {B} | {n} | {ms:.1f} | {base / ms:.2f}x | {ceil:.1f} | "
                         f"{ceil / ms:.0%} |")
            print(lines[-1], flush=True)
    shape = f", {cfg.num_layers} layers" if a.layers else ""
    record(f"Float32 decode by kernel layout ({a.preset}{shape}, StreamingLLM 4+252)",
           f"Median of {a.rounds} rounds of 10 steps, the layouts' rounds alternating:\n\n"
           + "\n".join(lines), dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
