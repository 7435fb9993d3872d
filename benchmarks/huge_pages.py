"""SmolLM2's decode with its weights on 2 MiB pages (as jaxllm loads them on a CPU:
jaxllm.pages) against the same weights copied by XLA into its own 4 KiB-page buffers, in one
process, calls alternated (a b, b a, ...; this VM's speed swings by 30% within minutes).

Each call decodes --new tokens after a --prompt-token prompt (StreamingLLM 4+1020); both sets
of weights must give the same tokens. The process's AnonHugePages (/proc/self/smaps_rollup)
says how much of the memory the kernel did back with huge pages.

    python benchmarks/huge_pages.py --formats 4bit,bfloat16,w8,float32 --reps 16
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _record import alternated_generate, record, steady_heap  # noqa: E402

FORMATS = ("4bit", "bfloat16", "w8", "float32")


def huge_mib() -> float:
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def compare(fmt: str, a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxllm
    from jaxllm import quant
    from jaxllm.corpus import builtin_corpus
    cfg, params, tok = jaxllm.load_model("smollm2", keep_quantized=fmt == "4bit")
    ids = tok.encode(builtin_corpus())[:a.prompt]
    if fmt == "bfloat16":
        params = quant.decode_weights(params, fmt)
    elif fmt == "w8":  # int8 weight-only, made in the process (smoothquant.quantize)
        params = jaxllm.smoothquant.quantize(
            params, cfg, np.asarray(ids * 4, np.int32)[:4 * 64], "w8", smooth=False,
            calib=jaxllm.CalibConfig(n_seqs=4, seq_len=64, batch=4))
    # JAX lets go of a deleted array's host buffer (here the float32 load's) only at its next
    # operation: run one first, so that AnonHugePages counts the measured weights alone
    jnp.zeros(()).block_until_ready()
    huge = huge_mib()
    r = alternated_generate({"2 MiB": (params, cfg),
                             "4 KiB": (jax.tree.map(jnp.copy, params), cfg)},
                            jnp.asarray([ids], jnp.int32), a.new, a.reps)
    return {**r, "huge": huge, "bytes": sum(x.nbytes for x in jax.tree.leaves(params))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="of " + ", ".join(FORMATS))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64, help="tokens decoded per call")
    ap.add_argument("--reps", type=int, default=16, help="calls of each set, alternated")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    rows = ["| weights | MiB | AnonHugePages MiB | 4 KiB pages ms/token | 2 MiB pages ms/token | "
            "2 MiB / 4 KiB | same tokens |", "|---|---:|---:|---:|---:|---:|---|"]
    for fmt in a.formats.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
        r = compare(fmt, a)
        m, s = r["med"], r["spread"]
        rows.append(f"| {fmt} | {r['bytes'] / 2**20:.0f} | {r['huge']:.0f} | {m['4 KiB']:.2f} "
                    f"({s['4 KiB'][0]:.2f}-{s['4 KiB'][1]:.2f}) | {m['2 MiB']:.2f} "
                    f"({s['2 MiB'][0]:.2f}-{s['2 MiB'][1]:.2f}) | "
                    f"{m['2 MiB'] / m['4 KiB']:.3f}x | {'yes' if r['same'] == 1 else 'NO'} |")
        print(rows[-1], flush=True)
    record("Weights on 2 MiB pages against 4 KiB pages (smollm2 decode)",
           f"Medians of {a.reps} generate calls of each set, alternated in one process (range in "
           f"brackets); {a.new} tokens a call after a {a.prompt}-token prompt, StreamingLLM "
           f"4+1020. The 4 KiB set is the same weights copied by XLA (jnp.copy):\n\n"
           + "\n".join(rows), dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
