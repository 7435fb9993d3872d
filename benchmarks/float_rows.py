"""SmolLM2's decode with float or int8 weight-only weights: the float kernel
(pallas_kernels/csrc/float_rows.cc) against XLA's forms, by batch size, in one process.

Both programs are the same model but for ``ModelConfig.kernels.int8`` ("auto": the kernel for
a few rows and for one row of an input wider than XLA fuses, jaxllm.weight_only; "xla": XLA's
forms everywhere).
Each call decodes --new tokens for every row of a batch from a cache filled with a --prompt
token prompt (StreamingLLM 4+1020); calls alternate between the two programs (a b, b a, ...),
since this VM's speed swings by 30% within minutes (docs/CPU.md, "Measuring a kernel change").

    python benchmarks/float_rows.py --formats bfloat16,w8 --batch 1,2,4 --reps 6
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _record import alternated_generate, record, steady_heap  # noqa: E402

FORMATS = ("bfloat16", "float16", "w8")


def convert(fmt: str, cfg, params, ids):
    import numpy as np

    import jaxllm
    from jaxllm import quant
    if fmt == "w8":
        calib = np.asarray(ids * 4, np.int32)[:4 * 64]
        params = jaxllm.smoothquant.quantize(params, cfg, calib, "w8", smooth=False,
                                             calib=jaxllm.CalibConfig(n_seqs=4, seq_len=64,
                                                                      batch=4))
    else:
        params = quant.decode_weights(params, fmt)
    return params


def compare(fmt: str, batch: int, a, ids, loaded) -> dict:
    import jax.numpy as jnp

    from jaxllm.config import Kernels
    cfg, params = loaded
    xla = dataclasses.replace(cfg, kernels=Kernels(int8="xla"))
    r = alternated_generate({"kernel": (params, cfg), "xla": (params, xla)},
                            jnp.asarray([ids] * batch, jnp.int32), a.new, a.reps)
    return {"format": fmt, "batch": batch, **r["med"], "same": r["same"], "spread": r["spread"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bfloat16,w8", help="of " + ", ".join(FORMATS))
    ap.add_argument("--batch", default="1,2,4")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per call")
    ap.add_argument("--reps", type=int, default=6, help="calls of each program, alternated")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    import jaxllm
    from jaxllm.corpus import builtin_corpus
    from pallas_kernels import cpu
    cfg, floats, tok = jaxllm.load_model("smollm2")
    ids = tok.encode(builtin_corpus())[:a.prompt]
    rows = ["| weights | batch | XLA's forms ms/step | kernel ms/step | kernel / XLA | "
            "tokens the same |", "|---|---:|---:|---:|---:|---:|"]
    for fmt in a.formats.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
        loaded = (cfg, convert(fmt, cfg, floats, ids))
        for b in (int(x) for x in a.batch.split(",")):
            r = compare(fmt, b, a, ids, loaded)
            rows.append(f"| {fmt} | {b} | {r['xla']:.2f} ({r['spread']['xla'][0]:.2f}-"
                        f"{r['spread']['xla'][1]:.2f}) | {r['kernel']:.2f} "
                        f"({r['spread']['kernel'][0]:.2f}-{r['spread']['kernel'][1]:.2f}) | "
                        f"{r['kernel'] / r['xla']:.2f}x | {r['same']:.0%} |")
            print(rows[-1], flush=True)
    record("Float kernel against XLA's forms in SmolLM2's decode (ms per step)",
           f"Medians of {a.reps} calls each, alternated in one process (range in brackets); "
           f"{a.new} tokens a call after a {a.prompt}-token prompt, StreamingLLM 4+1020; "
           f"{cpu.status_line('float rows')}:\n\n" + "\n".join(rows), dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
