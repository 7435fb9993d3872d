"""Weight-only products on XLA:CPU: which formulation reads a narrow weight in place, by shape
and number of rows (what ``jaxllm.weight_only.weight_only_matmul`` chooses from).

For each weight shape [out, in] (Pythia-160M's vocabulary head and MLP, Llama-7B's MLP) and each
number of input rows (decode batch), in one process, best of --calls:

- float32 ``x @ w`` with ``w`` [in, out]: the float32 model's product (XLA's own GEMM or
  matrix-vector kernel);
- narrow weight, ``x_r @ w.astype(f32).T`` per row: the vector-matrix form W8 used before;
- narrow weight, row reduction ``sum(w[:, None, :] * x[None], -1)``: one loop that reads each
  weight row once for all rows (one row padded to two);
- ``weight_only_matmul`` with ``backend="xla"``: the XLA form it chooses for these rows;
- ``weight_only_matmul`` as shipped: on a CPU with the float kernel
  (pallas_kernels/csrc/float_rows.cc), the kernel for 2 to ``cpu.FEW_ROWS_FLOAT`` rows (up
  to ``cpu.FEW_ROWS_FLOAT_WIDE`` for inputs wider than ``cpu.WIDE_INPUT``) and one row of an
  input wider than XLA fuses.

    python benchmarks/weight_only_forms.py
    python benchmarks/weight_only_forms.py --rows 1,8 --no-record
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import best_ms, record, steady_heap  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.weight_only import weight_only_matmul  # noqa: E402

SHAPES = {"pythia-160m head 50304x768": (50304, 768), "pythia-160m MLP up 3072x768": (3072, 768),
          "llama-7b MLP up 11008x4096": (11008, 4096)}
F32 = jnp.float32


def per_row(x, w):
    return jnp.concatenate([x[r:r + 1] @ w.astype(F32).T for r in range(x.shape[0])])


def row_reduce(x, w):
    x = jnp.concatenate([x, x]) if x.shape[0] == 1 else x
    return jnp.sum(w.astype(F32)[:, None, :] * x[None], axis=-1).T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8,32")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = ["| weight [out, in] | rows | float32 | int8 per row | int8 row reduction | "
            "int8 XLA's choice | int8 shipped | bf16 per row | bf16 row reduction | "
            "bf16 XLA's choice | bf16 shipped |",
            "|---|---:|" + "---:|" * 9]
    for label, (n_out, n_in) in SHAPES.items():
        w32 = jnp.asarray(rng.standard_normal((n_in, n_out)), F32)  # [in, out], as Linear's
        q = jnp.asarray(rng.integers(-127, 128, (n_out, n_in)), jnp.int8)
        wb = w32.T.astype(jnp.bfloat16)
        one = jnp.ones((), F32)
        for m in [int(r) for r in a.rows.split(",")]:
            x = jnp.asarray(rng.standard_normal((m, n_in)), F32)
            cells = [best_ms(jax.jit(lambda x, w: x @ w), x, w32, n=a.calls)]
            for w in (q, wb):
                ref = np.asarray(x, np.float64) @ np.asarray(w.astype(F32), np.float64).T
                for f in (per_row, row_reduce,
                          lambda x, w: weight_only_matmul(x, w, one, backend="xla"),
                          lambda x, w: weight_only_matmul(x, w, one)):
                    fn = jax.jit(f)
                    err = np.abs(np.asarray(fn(x, w)) - ref).max() / np.abs(ref).max()
                    assert err < 1e-5, (label, m, err)  # every form computes the same product
                    cells.append(best_ms(fn, x, w, n=a.calls))
            rows.append(f"| {label} | {m} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
            print(rows[-1], flush=True)
        del w32, q, wb
    from pallas_kernels import cpu
    record("Weight-only products on XLA:CPU by form (ms per call)",
           f"Best of {a.calls} calls, one process; int8 and bfloat16 weights stored [out, in]; "
           f"float32 is the float model's product of the same shape. Shipped: the float "
           f"kernel for 2-{cpu.FEW_ROWS_FLOAT} rows ({cpu.FEW_ROWS_FLOAT_WIDE} past "
           f"{cpu.WIDE_INPUT} inputs, and one row there) where the CPU has it "
           f"({cpu.status_line('float rows')}):\n\n" + "\n".join(rows),
           notes="What each form does and why the shipped one is chosen: docs/CPU.md, "
                 "\"Weight-only products\" and \"Float products\".",
           dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
