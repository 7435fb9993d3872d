"""Long-stream soak: N tokens (1M by default) through one StreamingLLM (or H2O / Q-Hitter: --method)
cache, recording the NLL
of every 10K-token bucket and the process's resident memory as the stream goes: constant memory,
no drift, no NaN. Prints a summary, writes bench_out/soak.{json,png}, appends to BENCHMARKS.md.
The text is the embedded corpus, repeated as often as needed."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _record import record  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "bench_out")


def rss_mb() -> float:
    """Current (not peak) resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:pythia-tiny")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--method", default="streaming", choices=["streaming", "h2o", "qhitter"])
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--kv-bits", type=int, default=4, help="qhitter's k-bit codes")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=10_000)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    import jax.numpy as jnp
    from tqdm import tqdm

    import jaxllm
    from jaxllm.corpus import builtin_corpus
    from jaxllm.policy import policy_of
    from jaxllm.ppl import nll_chunk
    cfg, params, tok = jaxllm.load_model(a.model)
    base = np.asarray(tok.encode(builtin_corpus()), np.int32)
    ids = np.resize(base, a.tokens + 1)  # the corpus repeated
    from jaxllm.kv.quantized import KVQuant
    kv = KVQuant("token", bits=a.kv_bits, group=0) if a.method == "qhitter" else None
    pc = policy_of(a.method, sinks=a.sinks, cache=a.cache, kv_quant=kv)
    cache = pc.make_cache(cfg, 1, 0)
    rows, acc, n_in, nan = [], 0.0, 0, 0
    t0 = time.perf_counter()
    C, B = a.chunk, a.bucket
    for s in tqdm(range(0, a.tokens, C), unit="chunk", mininterval=5):
        m = min(C, a.tokens - s)
        toks = np.zeros((1, C), np.int32)
        tgts = np.zeros((1, C), np.int32)
        toks[0, :m], tgts[0, :m] = ids[s:s + m], ids[s + 1:s + 1 + m]
        (nll, _), cache = nll_chunk(params, cfg, cache, jnp.asarray(toks), jnp.asarray(tgts),
                                     jnp.asarray([m], jnp.int32))
        v = np.asarray(nll)[0, :m].astype(np.float64)
        nan += int(np.isnan(v).sum())
        acc += float(np.nansum(v))
        n_in += m
        if n_in >= B or s + m == a.tokens:
            rows.append({"end": s + m, "ppl": math.exp(acc / n_in), "rss_mb": rss_mb(),
                         "seconds": time.perf_counter() - t0})
            acc, n_in = 0.0, 0
    rss = np.asarray([r["rss_mb"] for r in rows])
    ref = rss[min(2, len(rss) - 1)]  # after warm-up (compilation, first buffers)
    spread = float((rss[min(2, len(rss) - 1):].max() - ref) / ref)
    ppl = np.asarray([r["ppl"] for r in rows])
    half = len(ppl) // 2
    summary = {"model": a.model, "tokens": a.tokens, "cache": pc.label,
               "nan": nan, "rss_first_mb": float(ref), "rss_max_mb": float(rss.max()),
               "rss_growth": spread, "ppl_first_half": float(np.mean(ppl[:half])),
               "ppl_second_half": float(np.mean(ppl[half:])),
               "tokens_per_s": a.tokens / rows[-1]["seconds"], "buckets": rows}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "soak.json"), "w") as f:
        json.dump(summary, f, indent=2)
    from jaxllm.plots import figure
    with figure(os.path.join(OUT, "soak.png"), f"{a.model}: {a.tokens:,} tokens through "
                f"{summary['cache']}", size=(7, 4.6), nrows=2,
                sharex=True) as (a1, a2):
        a1.plot([r["end"] for r in rows], ppl)
        a1.set_ylabel(f"ppl per {B // 1000}K tokens")
        a2.plot([r["end"] for r in rows], rss)
        a2.set_ylabel("RSS (MiB)")
        a2.set_xlabel("tokens streamed")
    table = ("| tokens | cache | NaN | RSS after warm-up | RSS max | growth | ppl 1st half | "
             "ppl 2nd half | tokens/s |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
             f"| {a.tokens:,} | {summary['cache']} | {nan} | {ref:.0f} MiB | {rss.max():.0f} MiB "
             f"| {100 * spread:+.1f}% | {summary['ppl_first_half']:.3f} | "
             f"{summary['ppl_second_half']:.3f} | {summary['tokens_per_s']:.0f} |")
    notes = (f"Memory flat within ±5%: {'met' if abs(spread) <= 0.05 else 'NOT met'} "
             f"(current RSS sampled every {B:,} tokens; bench_out/soak.png plots both series). "
             f"The text is the embedded corpus repeated, so per-bucket ppl repeats with it.")
    record(f"Long-stream soak: {a.tokens:,} tokens through {pc.label}", table, notes,
           dry=a.no_record)


if __name__ == "__main__":
    main()
