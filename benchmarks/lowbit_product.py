"""The low-bit weight-only product (jaxllm.lowbit, GPTQ's and GGUF's layout) against W8
(int8 weight-only, jaxllm.quant.weight_only_matmul) and float32 at the same shapes, on this
machine: ms per call (best of n) at decode's few rows, compiled, the ratio to float32.

    python benchmarks/lowbit_product.py [--shapes 576x1536,1536x576,4096x11008] [--rows 1,8]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import best_ms, record  # noqa: E402

from jaxllm import gptq, lowbit  # noqa: E402
from jaxllm.quant import quantize_weight, weight_only_matmul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="576x1536,1536x576,4096x11008",
                    help="IN x OUT of the linear, comma-separated")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = ["| in x out | rows | float32 ms | W8 ms | "
            f"{a.bits}-bit g{a.group} ms | W8 / float | {a.bits}-bit / float |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for shape in a.shapes.split(","):
        n_in, n_out = (int(x) for x in shape.split("x"))
        kernel = jnp.asarray(rng.standard_normal((n_in, n_out)) * 0.02, jnp.float32)
        node, _ = gptq.quantize_linear(kernel, gptq.GPTQConfig("rtn", a.bits, a.group))
        w8 = quantize_weight(kernel, per_channel=True, act="none")
        f_float = jax.jit(lambda x, k: x @ k)
        f_w8 = jax.jit(lambda x, q, s: weight_only_matmul(x, q, s))
        f_low = jax.jit(lambda x, nd: lowbit.matmul(x, nd))
        for m in (int(r) for r in a.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, n_in)), jnp.float32)
            t_f = best_ms(f_float, x, kernel, n=a.n)
            t_8 = best_ms(f_w8, x, w8.q, w8.scale, n=a.n)
            t_l = best_ms(f_low, x, node, n=a.n)
            rows.append(f"| {n_in} x {n_out} | {m} | {t_f:.3f} | {t_8:.3f} | {t_l:.3f} | "
                        f"{t_8 / t_f:.2f}x | {t_l / t_f:.2f}x |")
            print(rows[-1], flush=True)
    record(f"Low-bit weight-only product vs W8 and float32 ({jax.devices()[0].platform})",
           "\n".join(rows), notes="One run; the low-bit product dequantizes in the step "
           "(jaxllm.lowbit.matmul), no kernel of its own yet.", dry=a.no_record)


if __name__ == "__main__":
    main()
