"""W8A8 matmul: Pallas int8 vs XLA int8 vs XLA bf16 on the linear shapes of Pythia-160M and
Llama-2-7B, M in {1, 16, 128, 512, 2048, 8192} (the Pallas-kernels issue's table).

Each row: time per product, achieved TOPS (2·M·N·K / t) and GB/s (int8 operands + output +
scales / t), and the speed-up of each int8 path over bf16. The ceilings are measured on the same
device first (a large bf16 and int8 GEMM, a large copy). Targets: int8 >= 1.6x bf16 at M >= 2048
(compute: the limit is 2x) and at M <= 16 (bytes: int8 weights are half of bf16's).

Each timed call streams ``copies`` distinct weight matrices (stacked along N, one kernel) and
the time per product is the call's over the copies: a lone product of these shapes would be
launch-bound or L2-resident, unlike a forward pass over many layers (``copies``).
On CPU the Pallas column is skipped (only its interpreter runs there; its timings mean nothing).
``--tune`` sweeps Pallas block sizes on each model's largest linear at ``--tune-m``.

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


TUNE_SHAPE = {"pythia-160m": "up", "llama2-7b": "gate+up"}  # each model's largest linear


def timeit(fn, *args, reps: int = 20) -> float:
    """Median seconds per call (compiled, warmed up, synchronised)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


STREAM_BYTES = 256 * 2**20  # stacked int8 weights per timed call: several times any L2 cache
OUT_BYTES = 512 * 2**20  # cap on the stacked output


def copies(M: int, K: int, N: int) -> int:
    """How many distinct weight matrices one timed call streams through.

    A lone product of these shapes is either launch-bound (microseconds) or served from the
    L2 cache (Pythia-160M's weights are 0.6-2.4 MB), neither of which is what a forward pass
    over many layers sees. So each timed call multiplies x by ``c`` different weights at once,
    stacked along N ([c*N, K], one kernel), and the time per product is the call's over ``c``."""
    if jax.default_backend() == "cpu":
        return 1
    return int(max(1, min(STREAM_BYTES // (N * K), OUT_BYTES // (2 * M * N), 256)))


def operands(rng, M: int, K: int, N: int, c: int):
    x8 = jnp.asarray(rng.integers(-127, 128, (M, K)), jnp.int8)
    w8 = jnp.asarray(rng.integers(-127, 128, (c * N, K)), jnp.int8)  # c weights stacked on N
    sx = jnp.asarray(rng.random(M) + 0.5, jnp.float32)
    sw = jnp.asarray(rng.random(c * N) + 0.5, jnp.float32)
    return x8, w8, sx, sw


def ceilings(backend: str) -> dict:
    """The device's measured ceilings: a large bf16 and int8 GEMM on random data, a large
    copy (bytes read + written)."""
    n = 8192 if jax.default_backend() != "cpu" else 2048
    rng = np.random.default_rng(1)
    a16 = jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16)
    a8 = jnp.asarray(rng.integers(-127, 128, (n, n)), jnp.int8)
    bf16 = timeit(jax.jit(lambda a, b: a @ b), a16, a16, reps=5)
    i8 = timeit(jax.jit(lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)), a8, a8, reps=5)
    big = jnp.asarray(rng.random(256 * 2**20 // 4), jnp.float32)  # 256 MiB
    copy = timeit(jax.jit(lambda x: x * 1.5), big, reps=5)
    out = {"bf16 TFLOP/s": 2 * n ** 3 / bf16 / 1e12, "XLA int8 TOPS": 2 * n ** 3 / i8 / 1e12,
           "copy GB/s": 2 * big.nbytes / copy / 1e9}
    if backend != "xla":
        p8 = timeit(jax.jit(lambda a, b: pk.w8a8_matmul(a, b, 1.0, 1.0, None, jnp.bfloat16,
                                                        backend=backend)), a8, a8, reps=5)
        out["Pallas int8 TOPS"] = 2 * n ** 3 / p8 / 1e12
    return out


def tune_candidates(M: int) -> list[Blocks]:
    """Block shapes worth trying per regime (Triton on Hopper: int8 tensor-core dots want
    bk >= 32; wgmma wants bm a multiple of 64, so decode's 16-row blocks take the mma path)."""
    if M <= 16:
        grid = itertools.product((16,), (32, 64, 128), (128, 256, 512), (4,), (3, 4))
    elif M <= 128:
        grid = itertools.product((64,), (64, 128, 256), (64, 128, 256), (4,), (3, 4))
    else:
        grid = itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4))
    return [Blocks(*g) for g in grid]


def tune(backend: str, M: int, x, w, sx, sw, c: int):
    """(seconds per product, Blocks) of the fastest candidate; shapes a lowering rejects are
    skipped (and counted)."""
    best, rejected = None, 0
    for b in tune_candidates(M):
        try:
            t = timeit(jax.jit(lambda x, w, sx, sw, b=b: pk.w8a8_matmul(
                x, w, sx, sw, None, jnp.bfloat16, backend=backend, blocks=b)), x, w, sx, sw,
                reps=5) / c
        except Exception:  # noqa: BLE001 - a block shape the lowering rejects
            rejected += 1
            continue
        if best is None or t < best[0]:
            best = (t, b)
    return best, rejected


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="pythia-160m,llama2-7b")
    ap.add_argument("--m", default="1,16,128,512,2048,8192")
    ap.add_argument("--tune", action="store_true",
                    help="sweep Pallas block sizes on each model's largest linear")
    ap.add_argument("--tune-m", default="1,16,128,2048,8192", help="M values to tune at")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args(argv)
    # triton on GPU, tpu on TPU; on CPU only XLA's dot (the few-row CPU kernel has its own
    # table: benchmarks/int8_rows.py)
    backend = {"cpu": "xla"}.get(pk.resolve_backend(), pk.resolve_backend())
    ceil = ceilings(backend)
    rng = np.random.default_rng(0)
    rows = ["| model | linear | M | K | N | copies | bf16 ms | XLA int8 ms | Pallas int8 ms | "
            "XLA int8 / bf16 | Pallas / bf16 | Pallas TOPS | Pallas GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    tuned = []
    tune_ms = {int(m) for m in a.tune_m.split(",")} if a.tune else set()
    for model in a.models.split(","):
        for (name, K, N), M in itertools.product(SHAPES[model], map(int, a.m.split(","))):
            c = copies(M, K, N)
            x8, w8, sx, sw = operands(rng, M, K, N, c)
            x16, w16 = x8.astype(jnp.bfloat16), w8.T.astype(jnp.bfloat16)  # bf16 weight [K, cN]
            t16 = timeit(jax.jit(lambda x, w: x @ w), x16, w16) / c
            del w16
            txla = timeit(jax.jit(lambda x, w, sx, sw: pk.w8a8_matmul(
                x, w, sx, sw, None, jnp.bfloat16, backend="xla")), x8, w8, sx, sw) / c
            tp = None
            if backend != "xla":
                tp = timeit(jax.jit(lambda x, w, sx, sw: pk.w8a8_matmul(
                    x, w, sx, sw, None, jnp.bfloat16, backend=backend)), x8, w8, sx, sw) / c
                if M in tune_ms and name == TUNE_SHAPE[model]:
                    best, rejected = tune(backend, M, x8, w8, sx, sw, c)
                    if best:
                        tuned.append(f"- {model} {name} M={M}: best {best[1]} "
                                     f"{best[0] * 1e3:.4f} ms vs default {tp * 1e3:.4f} ms "
                                     f"({len(tune_candidates(M))} tried, {rejected} rejected)")
                        print(tuned[-1], flush=True)
            nbytes = M * K + N * K + 2 * M * N + 4 * (M + N)
            fmt = lambda t: "-" if t is None else f"{t * 1e3:.4f}"  # noqa: E731
            rows.append(
                f"| {model} | {name} | {M} | {K} | {N} | {c} | {t16 * 1e3:.4f} | "
                f"{txla * 1e3:.4f} | "
                f"{fmt(tp)} | {t16 / txla:.2f}x | {'-' if tp is None else f'{t16 / tp:.2f}x'} | "
                f"{'-' if tp is None else f'{2 * M * N * K / tp / 1e12:.1f}'} | "
                f"{'-' if tp is None else f'{nbytes / tp / 1e9:.0f}'} |")
            print(rows[-1], flush=True)
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
