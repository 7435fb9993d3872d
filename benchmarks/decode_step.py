"""Per-step decode time of the jitted forward with a donated StreamingLLM cache, by batch size.

A first look at decode cost (the full latency study vs dense and recompute is the evaluation
issue's). Prints ms/step and tokens/s for each batch size.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from _record import full_ring, record, steady_heap, time_decode  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.model import apply  # noqa: E402
from jaxllm.policy import StreamingLLM  # noqa: E402


def bandwidth_line() -> str:
    """This machine's memory bandwidth in and out of CPU cache: a decode step reads the whole
    KV cache several times (rotate keys, score, weight values), so once the cache outgrows the
    last-level cache the step time follows DRAM bandwidth."""
    out = []
    for mib in (4, 64):
        x = jnp.ones((mib * 2**18,), jnp.float32)
        f = jax.jit(lambda x: x * 1.5)
        f(x).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(20):
            y = f(x)
        y.block_until_ready()
        secs = (time.perf_counter() - t0) / 20
        out.append(f"{mib} MiB: {2 * mib / 1024 / secs:.1f} GB/s")
    return "Streaming bandwidth (x * 1.5, read + write): " + ", ".join(out) + "."


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="pythia-14m")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    cfg = jaxllm.PRESETS[a.preset]
    params = jaxllm.init_params(cfg, jax.random.key(0))
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    lines = ["| batch | cache | K+V cache (MiB) | ms/step | tokens/s | cache bytes / step time |",
             "|---:|---|---:|---:|---:|---:|"]
    pc = StreamingLLM(a.sinks, a.cache)
    for B in [int(b) for b in a.batch.split(",")]:
        ms, cache = time_decode(step, params, full_ring(pc.make_cache(cfg, B, 0)), a.steps,
                                warmup=3)
        mib = sum(x.nbytes for x in cache.k + cache.v) / 2**20
        lines.append(f"| {B} | {pc.label} | {mib:.0f} | {ms:.2f} | "
                     f"{B * 1e3 / ms:.0f} | {mib / 1024 / (ms / 1e3):.1f} GB/s |")
    table = "\n".join(lines) + "\n\n" + bandwidth_line()
    record(f"Decode step, {a.preset} (random weights), StreamingLLM cache, full ring", table,
           dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
