"""Prefill's temporary memory as XLA states it at compile time, for any model size, on any machine:
``jax.jit(apply).lower(abstract arrays).compile().memory_analysis()``, nothing allocated.

Llama-2-7B layer shapes (2 of its 32 layers: temporaries are per layer, reused layer to layer),
bfloat16 weights and a StreamingLLM 4+4092 bfloat16 cache, one chunk of T prompt tokens at
batch B through ``jaxllm.model.apply`` (all T positions' logits: those are its output, not
temporaries). With the scores materialised (``--attention materialised``: every chunk's
[T, S+W+T] float32 scores) this was 11.4 GiB at 1 x 4,096 and 79 GiB at 8 x 4,096; blockwise
(the default here, jaxllm.attention.flash) and in prefill blocks of at most 4,096 rows, it no
longer grows with T. Compiled for this machine's backend: on a CPU the figure includes XLA:CPU's
float32 copies of bfloat16 operands (it has no bfloat16 arithmetic), which a GPU does not make.

    python benchmarks/prefill_memory.py [--shapes 1x4096,8x2048,8x4096] [--layers 2]
        [--attention blockwise|materialised]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from _record import record  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.config import Kernels  # noqa: E402
from jaxllm.model import apply  # noqa: E402


def prefill_temp_bytes(cfg, batch: int, tokens: int, sinks: int, window: int) -> int:
    """Bytes of temporaries XLA allocates for one prefill chunk of ``tokens`` at ``batch``
    through a ``sinks + window`` bfloat16 cache (params and cache abstract, the cache donated)."""
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, batch, sinks=sinks, window=window,
                                                     dtype=jnp.bfloat16))
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    compiled = step.lower(params, tokens=jax.ShapeDtypeStruct((batch, tokens), jnp.int32),
                          cache=cache, lens=jax.ShapeDtypeStruct((batch,), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x4096,8x2048,8x4096", help="BATCHxTOKENS, comma-separated")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=4092)
    ap.add_argument("--attention", default="blockwise", choices=("blockwise", "materialised"))
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    cfg = dataclasses.replace(jaxllm.PRESETS["llama2-7b"], num_layers=a.layers,
                              kernels=Kernels(attention=a.attention))
    rows = ["| batch x prompt tokens | temporaries (GiB) |", "|---|---:|"]
    for shape in a.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        gib = prefill_temp_bytes(cfg, B, T, a.sinks, a.window) / 2 ** 30
        rows.append(f"| {B} x {T} | {gib:.1f} |")
    record(f"Prefill temporaries at compile time (Llama-2-7B shapes, {a.layers} layers, "
           f"bfloat16, StreamingLLM {a.sinks}+{a.window}, {a.attention} attention, "
           f"{jax.default_backend()})",
           "\n".join(rows), dry=a.no_record)


if __name__ == "__main__":
    main()
