"""Few-row int8 products on CPU: XLA's int8 dot (``backend="xla"``) against the hand-written
VNNI kernel (pallas_kernels/cpu.py, ``backend="cpu"``), for M rows through every linear layer of
a model, chained as in a decode step (each product's output feeds the next one's input, so
nothing runs concurrently that a step would not), plus the head.

Each row: ms for the whole chain per path (best of ``--reps``, the two paths alternating), the
weights' bytes over that time, and the speed-up. Both paths' int32 products are checked equal.

    python benchmarks/int8_rows.py [--model pythia-160m] [--m 1,2,4,8,16,32,64] [--no-record]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _record import best_ms, record, steady_heap  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from jaxllm.config import PRESETS  # noqa: E402


def linear_shapes(cfg, layers: int) -> list[tuple[int, int]]:
    """(N, K) of every layer's weights [out, in] in order, and the head's: q, k and v as one
    product (the model runs them as three; the bytes are the same), gate and up as one."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    up = 2 * f if cfg.mlp == "swiglu" else f
    return [(qkv, d), (d, cfg.num_heads * cfg.head_dim), (up, d), (d, f)] * layers + [
        (cfg.vocab_size, d)]


def chain(backend: str):
    """One jit over the chain: each product's int32 output, reduced mod 127 to int8, is the next
    input (tiled or cut to the next K)."""
    def run(x, ws):
        total = jnp.zeros((), jnp.int32)
        for w in ws:
            K = w.shape[1]
            xk = jnp.tile(x, (1, -(-K // x.shape[1])))[:, :K]
            y = pk.w8a8_matmul(xk, w, 1.0, 1.0, out_dtype=jnp.int32, backend=backend)
            x = (y % 127).astype(jnp.int8)
            total = total + y.sum()
        return total
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pythia-160m", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own")
    ap.add_argument("--m", default="1,2,4,8,16,32,64", help="rows per product")
    ap.add_argument("--reps", type=int, default=3, help="alternating rounds (best of 10 each)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args(argv)
    if jax.default_backend() != "cpu" or not pk.cpu.available():
        print(f"nothing to compare here: {pk.cpu.status()} (backend {jax.default_backend()})")
        return 0
    cfg = PRESETS[a.model]
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.integers(-127, 128, s, dtype=np.int8))
          for s in linear_shapes(cfg, a.layers or cfg.num_layers)]
    nbytes = sum(w.nbytes for w in ws)
    rows = ["| M | XLA int8 (ms) | kernel (ms) | XLA GB/s | kernel GB/s | kernel speed-up |",
            "|---:|---:|---:|---:|---:|---:|"]
    xla, ker = chain("xla"), chain("cpu")
    for M in map(int, a.m.split(",")):
        x = jnp.asarray(rng.integers(-127, 128, (M, cfg.hidden_size), dtype=np.int8))
        if int(xla(x, ws)) != int(ker(x, ws)):
            raise SystemExit(f"M={M}: the kernel's products differ from XLA's")
        tx, tk = float("inf"), float("inf")
        for _ in range(a.reps):
            tx = min(tx, best_ms(xla, x, ws, n=10))
            tk = min(tk, best_ms(ker, x, ws, n=10))
        rows.append(f"| {M} | {tx:.2f} | {tk:.2f} | {nbytes / tx / 1e6:.1f} | "
                    f"{nbytes / tk / 1e6:.1f} | {tx / tk:.2f}x |")
        print(rows[-1], flush=True)
    notes = (f"{a.model}, {a.layers or cfg.num_layers} layers: {len(ws)} int8 weights "
             f"({nbytes / 2**20:.0f} MiB) chained, each product's output the next one's input; "
             f"best of {a.reps} alternating rounds of best-of-10; int32 results equal. "
             f"{pk.cpu.status_line('int8 rows')}.")
    record(f"INT8 rows: XLA int8 dot vs the VNNI kernel ({a.model}, CPU)", "\n".join(rows),
           notes, dry=a.no_record)
    return 0


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    raise SystemExit(main())
