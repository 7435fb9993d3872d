"""W8A8 matmul: Pallas int8 vs XLA int8 vs XLA bf16 on the linear shapes of Pythia-160M and
Llama-2-7B, M in {1, 16, 128, 512, 2048, 8192} (the Pallas-kernels issue's table).

Each row: time per product, achieved TOPS (2·M·N·K / t) and GB/s (int8 operands + output +
scales / t), and the speed-up of each int8 path over bf16. The ceilings are measured on the same
device first (a large bf16 and int8 GEMM, a large copy). Targets: int8 >= 1.6x bf16 at M >= 2048
(compute: the limit is 2x) and at M <= 16 (bytes: int8 weights are half of bf16's).

On CPU the Pallas column is skipped (only its interpreter runs there; its timings mean nothing).
``--tune`` sweeps Pallas block sizes per shape and prints the best.

    python benchmarks/int8_matmul.py [--models pythia-160m,llama2-7b] [--m 1,16,...] [--tune]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _record import record  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels.matmul import Blocks  # noqa: E402

# (name, K, N) of each linear: in-features, out-features.
SHAPES = {
    "pythia-160m": [("qkv", 768, 2304), ("o", 768, 768), ("up", 768, 3072), ("down", 3072, 768)],
    "llama2-7b": [("qkv", 4096, 12288), ("o", 4096, 4096), ("gate+up", 4096, 22016),
                  ("down", 11008, 4096)],
}


def timeit(fn, *args, reps: int = 20) -> float:
    """Median seconds per call (compiled, warmed up, synchronised)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def ceilings(backend: str) -> dict:
    n = 8192 if jax.default_backend() != "cpu" else 2048
    a16 = jnp.ones((n, n), jnp.bfloat16)
    a8 = jnp.ones((n, n), jnp.int8)
    bf16 = timeit(jax.jit(lambda a, b: a @ b), a16, a16, reps=5)
    i8 = timeit(jax.jit(lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)), a8, a8, reps=5)
    big = jnp.ones((256 * 2**20 // 4,), jnp.float32)  # 256 MiB
    copy = timeit(jax.jit(lambda x: x + 1), big, reps=5)
    out = {"bf16 TFLOP/s": 2 * n ** 3 / bf16 / 1e12, "XLA int8 TOPS": 2 * n ** 3 / i8 / 1e12,
           "copy GB/s": 2 * big.nbytes / copy / 1e9}
    if backend != "xla":
        p8 = timeit(jax.jit(lambda a, b: pk.w8a8_matmul(a, b, 1.0, 1.0, jnp.bfloat16,
                                                        backend=backend)), a8, a8, reps=5)
        out["Pallas int8 TOPS"] = 2 * n ** 3 / p8 / 1e12
    return out


def tune(backend: str, M: int, K: int, N: int, x, w, sx, sw):
    cands = [Blocks(bm, bn, bk, nw, ns) for bm, bn, bk, nw, ns in itertools.product(
        (16, 64, 128) if M <= 16 else (64, 128, 256), (64, 128, 256), (64, 128, 256),
        (4, 8), (3, 4)) if bm <= max(16, M)]
    best = None
    for b in cands:
        try:
            t = timeit(jax.jit(lambda x, w, sx, sw, b=b: pk.w8a8_matmul(
                x, w, sx, sw, None, jnp.bfloat16, backend=backend, blocks=b)), x, w, sx, sw,
                reps=5)
        except Exception:  # noqa: BLE001 - a block shape the lowering rejects
            continue
        if best is None or t < best[0]:
            best = (t, b)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="pythia-160m,llama2-7b")
    ap.add_argument("--m", default="1,16,128,512,2048,8192")
    ap.add_argument("--tune", action="store_true", help="sweep Pallas block sizes per shape")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args(argv)
    backend = pk.resolve_backend()  # triton on GPU, tpu on TPU, xla on CPU
    ceil = ceilings(backend)
    rng = np.random.default_rng(0)
    rows = ["| model | linear | M | K | N | bf16 ms | XLA int8 ms | Pallas int8 ms | "
            "XLA int8 / bf16 | Pallas / bf16 | Pallas TOPS | Pallas GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    tuned = []
    for model in a.models.split(","):
        for (name, K, N), M in itertools.product(SHAPES[model], map(int, a.m.split(","))):
            x8 = jnp.asarray(rng.integers(-127, 128, (M, K)), jnp.int8)
            w8 = jnp.asarray(rng.integers(-127, 128, (N, K)), jnp.int8)
            sx = jnp.asarray(rng.random(M), jnp.float32)
            sw = jnp.asarray(rng.random(N), jnp.float32)
            x16, w16 = x8.astype(jnp.bfloat16), w8.T.astype(jnp.bfloat16)  # bf16 weight [K, N]
            t16 = timeit(jax.jit(lambda x, w: x @ w), x16, w16)
            txla = timeit(jax.jit(lambda x, w, sx, sw: pk.w8a8_matmul(
                x, w, sx, sw, None, jnp.bfloat16, backend="xla")), x8, w8, sx, sw)
            tp = None
            if backend != "xla":
                tp = timeit(jax.jit(lambda x, w, sx, sw: pk.w8a8_matmul(
                    x, w, sx, sw, None, jnp.bfloat16, backend=backend)), x8, w8, sx, sw)
                if a.tune:
                    best = tune(backend, M, K, N, x8, w8, sx, sw)
                    if best:
                        tuned.append(f"- {model} {name} M={M}: {best[1]} {best[0] * 1e3:.3f} ms")
            nbytes = M * K + N * K + 2 * M * N + 4 * (M + N)
            fmt = lambda t: "-" if t is None else f"{t * 1e3:.3f}"  # noqa: E731
            rows.append(
                f"| {model} | {name} | {M} | {K} | {N} | {t16 * 1e3:.3f} | {txla * 1e3:.3f} | "
                f"{fmt(tp)} | {t16 / txla:.2f}x | {'-' if tp is None else f'{t16 / tp:.2f}x'} | "
                f"{'-' if tp is None else f'{2 * M * N * K / tp / 1e12:.1f}'} | "
                f"{'-' if tp is None else f'{nbytes / tp / 1e9:.0f}'} |")
    notes = ("Measured ceilings on this device: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                              ceil.items()) + f". INT8 backend: "
             f"{backend}" + (" (no Pallas column: on CPU only its interpreter runs)."
                             if backend == "xla" else "."))
    if tuned:
        notes += "\n\nBest Pallas blocks (--tune):\n" + "\n".join(tuned)
    table = "\n".join(rows)
    record(f"INT8 matmul: Pallas vs XLA int8 vs bf16 ({jax.devices()[0].device_kind})",
               table, notes, dry=a.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
