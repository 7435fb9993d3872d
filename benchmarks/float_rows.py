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
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _record import record, steady_heap  # noqa: E402

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
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxllm
    from jaxllm.config import Kernels
    cfg, params = loaded
    cfgs = {"kernel": cfg, "xla": dataclasses.replace(cfg, kernels=Kernels(int8="xla"))}
    prompt = jnp.asarray([ids] * batch, jnp.int32)
    filled = jaxllm.generate(params, cfg, prompt, jaxllm.init_cache(cfg, batch, sinks=4,
                                                                    window=1020),
                             jaxllm.SamplingConfig(max_new_tokens=1)).cache
    last = prompt[:, -1:]
    sc = jaxllm.SamplingConfig(max_new_tokens=a.new)

    def run(k):
        cache = jax.tree.map(lambda x: x.copy(), filled)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        out = jaxllm.generate(params, cfgs[k], last, cache, sc)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / a.new * 1e3, np.asarray(out.tokens)

    first = {k: run(k)[1] for k in cfgs}  # compiles each
    times = {k: [] for k in cfgs}
    for i in range(a.reps):
        for k in (("kernel", "xla") if i % 2 == 0 else ("xla", "kernel")):
            times[k].append(run(k)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    same = float((first["kernel"] == first["xla"]).mean())
    return {"format": fmt, "batch": batch, **med, "same": same,
            "spread": {k: (min(v), max(v)) for k, v in times.items()}}


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
           f"{cpu.status().splitlines()[2]}:\n\n" + "\n".join(rows), dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
