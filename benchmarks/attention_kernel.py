"""The decode step with and without the CPU decode-attention kernel
(pallas_kernels/csrc/decode_attention.cc), interleaved in one process: Pythia-160M shapes,
random weights, a full StreamingLLM ring (every slot attended, as in steady streaming).

Each (format, cache, batch) compiles the step twice, with ``Kernels(attention="auto")`` (the
kernel) and ``"materialised"`` (XLA's form: jaxllm.attention.decode.attend_cache's one pass by
head groups), then alternates timed rounds of the two; the table shows medians.

    python benchmarks/attention_kernel.py [--formats float32,bf16kv,w8a8] [--caches 252,4092]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import full_ring, record, steady_heap, time_decode  # noqa: E402
from roofline import FORMATS, LABELS, variant  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.model import apply  # noqa: E402
from jaxllm.policy import StreamingLLM  # noqa: E402
from pallas_kernels import cpu  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="pythia-160m")
    ap.add_argument("--formats", default="float32,bf16kv,w8a8", help="of " + ", ".join(FORMATS))
    ap.add_argument("--caches", default="252,4092", help="window sizes (4 sinks each)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    if not cpu.attention_available():
        print(f"nothing to compare here: {cpu.status()}")
        return
    cfg0 = jaxllm.PRESETS[a.preset]
    params0 = jaxllm.init_params(cfg0, jax.random.key(0))
    models = {f: variant(f, cfg0, params0) for f in a.formats.split(",")}
    lines = ["| format | cache | batch | kernel ms/step | without ms/step | speed-up |",
             "|---|---|---:|---:|---:|---:|"]
    for W in [int(x) for x in a.caches.split(",")]:
        pc = StreamingLLM(4, 4 + W)
        for B in [int(x) for x in a.batch.split(",")]:
            for f, (cfg, params, kv_dtype) in models.items():
                runs = {}
                for path, form in (("kernel", "auto"), ("without", "materialised")):
                    c = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, attention=form))
                    step = jax.jit(functools.partial(apply, cfg=c), donate_argnames=("cache",))
                    cache = full_ring(pc.make_cache(cfg, B, 0, dtype=kv_dtype))
                    _, cache = time_decode(step, params, cache, 1, warmup=1)  # traced here
                    runs[path] = [step, cache, []]
                steps = 5 if W > 1000 else 10
                for _ in range(a.rounds):
                    for run in runs.values():
                        ms, run[1] = time_decode(run[0], params, run[1], steps, warmup=1)
                        run[2].append(ms)
                on, off = (float(np.median(runs[p][2])) for p in ("kernel", "without"))
                lines.append(f"| {LABELS[f]} | {pc.label} | {B} | {on:.1f} | {off:.1f} | "
                             f"{off / on:.2f}x |")
                print(lines[-1], flush=True)
                del runs
    record(f"Decode step with and without the CPU attention kernel ({a.preset}, "
           f"{cpu.attention_isa()})",
           f"Median of {a.rounds} rounds each, the two interleaved "
           f"({cpu.status_line('decode attention')}):\n\n" + "\n".join(lines), dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
