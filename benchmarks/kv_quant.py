"""Quantized KV cache: perplexity, bytes per token and decode speed per storage format.

Three tables, appended to docs/BENCHMARKS.md:

1. perplexity of the embedded models streamed through StreamingLLM (--sinks + the rest of
   --cache) with each KV format, against the float cache (held-out: the corpus' second half);
2. KV bytes per cached token for the embedded model, Pythia-160M and Llama-2-7B shapes, measured
   from the arrays of a --cache-slot cache (codes, scales, minima and the float sinks included);
3. decode ms/token (one step of a full cache, random Pythia-160M weights) per cache size and
   batch.

    python benchmarks/kv_quant.py                       # all three, CPU-sized defaults
    python benchmarks/kv_quant.py --timing-caches 256,1024,4096 --timing-batch 1,8
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import record, time_decode  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.kv.cache import kv_bytes  # noqa: E402
from jaxllm.corpus import builtin_corpus  # noqa: E402
from jaxllm.kv.quantized import KVQuant  # noqa: E402
from jaxllm.model import apply  # noqa: E402
from jaxllm.policy import KVStorage, StreamingLLM  # noqa: E402
from jaxllm.ppl import stream_nll  # noqa: E402

FORMATS = {"float": KVQuant(), "int8": KVQuant("int8"), "token-8": KVQuant("token", 8, 32),
           "token-4": KVQuant("token", 4, 32), "token-3": KVQuant("token", 3, 32),
           "token-2": KVQuant("token", 2, 32), "kivi-4": KVQuant("kivi", 4, 32, residual=32),
           "kivi-2": KVQuant("kivi", 2, 32, residual=32)}


def fit(spec: KVQuant, head_dim: int) -> KVQuant:
    """Group 32, or the largest divisor of head_dim below it (16 for the embedded models' 48)."""
    return dataclasses.replace(spec, group=math.gcd(spec.group, head_dim)) if spec.enabled \
        and spec.format != "int8" else spec


def perplexity_table(a) -> str:
    lines = ["| model | format | ppl | vs float |", "|---|---|---:|---:|"]
    for model in a.models.split(","):
        cfg, params, tok = jaxllm.load_model(model)
        ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
        ids = ids[len(ids) // 2:][:a.tokens]  # held out from the SmoothQuant calibration half
        base = None
        for name in a.formats.split(","):
            spec = fit(FORMATS[name], cfg.head_dim)
            pc = StreamingLLM(a.sinks, a.cache, KVStorage(quant=spec))
            ppl = float(np.exp(stream_nll(params, cfg, ids, pc, chunk=a.chunk).astype(
                np.float64).mean()))
            base = ppl if base is None else base
            lines.append(f"| {model} | {pc.label} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def bytes_table(a) -> str:
    lines = ["| shape | format | KV bytes / token | vs float16 |", "|---|---|---:|---:|"]
    shapes = {"embedded": jaxllm.load_model("embedded")[0],
              "pythia-160m": jaxllm.PRESETS["pythia-160m"],
              "llama2-7b": jaxllm.PRESETS["llama2-7b"]}
    for label, cfg in shapes.items():
        # One layer's cache, measured, times the layers (the layers are identical).
        one = dataclasses.replace(cfg, num_layers=1)
        ref = None
        for name in ["float"] + [f for f in a.formats.split(",") if f != "float"]:
            spec = fit(FORMATS[name], cfg.head_dim)
            c = jaxllm.init_cache(one, 1, a.sinks, a.bytes_cache, dtype=jnp.float16,
                                  kv_quant=spec)
            per = kv_bytes(c) * cfg.num_layers / (a.sinks + a.bytes_cache)
            ref = per if ref is None else ref
            lines.append(f"| {label} | {'float16' if name == 'float' else spec.describe()} | "
                         f"{per:,.0f} | {per / ref:.3f}x |")
    return "\n".join(lines)


def timing_table(a) -> str:
    cfg = jaxllm.PRESETS[a.timing_preset]
    params = jaxllm.init_params(cfg, jax.random.key(0))
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    lines = ["| cache (sinks + window) | batch | format | ms/token | tokens/s |",
             "|---|---:|---|---:|---:|"]
    for L in [int(x) for x in a.timing_caches.split(",")]:
        for B in [int(x) for x in a.timing_batch.split(",")]:
            for name in a.formats.split(","):
                spec = fit(FORMATS[name], cfg.head_dim)
                cache = jaxllm.init_cache(cfg, B, a.sinks, L, kv_quant=spec)
                ms, _ = time_decode(step, params, cache, a.steps)
                lines.append(f"| {a.sinks}+{L} | {B} | {spec.describe()} | {ms:.2f} | "
                             f"{B * 1e3 / ms:.0f} |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,embedded-sink")
    ap.add_argument("--formats",
                    default="float,int8,token-8,token-4,token-3,token-2,kivi-4,kivi-2")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--cache", type=int, default=132,
                    help="StreamingLLM cache for perplexity (4+128: KIVI needs the window to be "
                         "a multiple of its residual, 32)")
    ap.add_argument("--chunk", type=int, default=1,
                    help="tokens per forward call when scoring: 1 is decoding (KIVI attends to a "
                         "chunk's own tokens in full precision, so longer chunks flatter it)")
    ap.add_argument("--bytes-cache", type=int, default=4096,
                    help="window slots (after the sinks) for the bytes table")
    ap.add_argument("--timing-preset", default="pythia-160m")
    ap.add_argument("--timing-caches", default="256,1024,4096", help="windows (after the sinks)")
    ap.add_argument("--timing-batch", default="1,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", default="", help="comma-separated: ppl, bytes, timing")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    skip = set(a.skip.split(",")) - {""}
    parts = []
    if "ppl" not in skip:
        parts.append(f"Perplexity, StreamingLLM {a.sinks}+{a.cache - a.sinks}, {a.tokens} "
                     f"held-out tokens, {a.chunk} token(s) per forward call:\n\n"
                     + perplexity_table(a))
    if "bytes" not in skip:
        parts.append(f"KV bytes per token, a {a.sinks}+{a.bytes_cache} cache (float16 sinks), "
                     f"measured from the arrays:\n\n" + bytes_table(a))
    if "timing" not in skip:
        parts.append(f"Decode step, {a.timing_preset} (random weights), full StreamingLLM "
                     f"cache, dequantize-then-dot in XLA:\n\n" + timing_table(a))
    record("Quantized KV cache: quality, bytes, decode speed", "\n\n".join(parts),
           dry=a.no_record)


if __name__ == "__main__":
    main()
