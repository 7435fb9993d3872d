"""The low-bit weight-only product (jaxllm.lowbit, GPTQ's and GGUF's layout) against W8
(int8 weight-only, jaxllm.weight_only.weight_only_matmul) and float32 at the same shapes, on this
machine: ms per call (best of n) at decode's few rows, compiled, the ratio to float32; then
a whole decode step of a model (default the packaged SmolLM2-135M) with its linears in each
format: ms per token of jaxllm.generate's compiled loop (a 4 + 252 cache, batch 1). The
embedding and head stay float32 in every row, so the rows differ in the linears only.

    python benchmarks/lowbit_product.py [--shapes 576x1536,1536x576,4096x11008] [--rows 1,8]
                                        [--model smollm2] [--steps 32]
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
from jaxllm.quant import quantize_weight  # noqa: E402
from jaxllm.weight_only import weight_only_matmul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="576x1536,1536x576,4096x11008",
                    help="IN x OUT of the linear, comma-separated")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--model", default="smollm2", help="the decode-step table's model ('' skips)")
    ap.add_argument("--steps", type=int, default=32)
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
    if a.model:
        rows += ["", *decode_rows(a.model, a.bits, a.group, a.steps)]
    platform = jax.devices()[0].platform
    record(f"Low-bit weight-only product and decode step vs W8 and float32 ({platform})",
           "\n".join(rows), notes="One run. On CPU the low-bit product dequantizes inside the "
           "step (jaxllm.lowbit.xla_matmul); on GPU/TPU the Pallas kernel "
           "(pallas_kernels.packed_matmul) reads the packed codes.", dry=a.no_record)


def decode_rows(model: str, bits: int, group: int, steps: int) -> list[str]:
    """ms per decode step of ``model`` with float32, W8 and k-bit RTN linears."""
    import jaxllm
    from _record import time_generate
    from jaxllm import smoothquant as sq
    cfg, params, _ = jaxllm.load_model(model)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    w8 = sq.quantize(params, cfg, np.zeros(512, np.int32), "w8", smooth=False,
                     quantize_embedding=False, quantize_head=False,
                     calib=sq.CalibConfig(n_seqs=1, seq_len=64, batch=1))
    low, _ = gptq.quantize_model(params, cfg, np.zeros((1, 8), np.int32),
                                 gptq.GPTQConfig("rtn", bits, group))
    out = [f"| {model} decode step (4 + 252 cache, batch 1) | linears | ms per token | "
           "vs float32 |", "|---|---|---:|---:|"]
    base = None
    for name, p in [("float32", params), ("W8", w8), (f"{bits}-bit g{group} RTN", low)]:
        cache = jaxllm.init_cache(cfg, 1, sinks=4, window=252)
        ms, _ = time_generate(p, cfg, cache, steps)
        base = base or ms
        out.append(f"| | {name} | {ms:.2f} | {ms / base:.2f}x |")
        print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    main()
