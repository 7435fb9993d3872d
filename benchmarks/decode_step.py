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
from _record import record  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.model import _forward  # noqa: E402


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
    step = jax.jit(functools.partial(_forward, cfg=cfg), donate_argnames=("cache",))
    lines = ["| batch | cache | ms/step | tokens/s |", "|---:|---|---:|---:|"]
    for B in [int(b) for b in a.batch.split(",")]:
        cache = jaxllm.init_cache(cfg, B, a.sinks, a.cache - a.sinks)
        tok, lens = jnp.ones((B, 1), jnp.int32), jnp.ones((B,), jnp.int32)
        for _ in range(3):
            logits, cache = step(params, tokens=tok, cache=cache, lens=lens)
        logits.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            logits, cache = step(params, tokens=tok, cache=cache, lens=lens)
        logits.block_until_ready()
        ms = (time.perf_counter() - t0) / a.steps * 1e3
        lines.append(f"| {B} | {a.sinks}+{a.cache - a.sinks} | {ms:.2f} | {B * 1e3 / ms:.0f} |")
    table = "\n".join(lines)
    if a.no_record:
        print(table)
    else:
        record(f"Decode step, {a.preset} (random weights), StreamingLLM cache", table)


if __name__ == "__main__":
    main()
