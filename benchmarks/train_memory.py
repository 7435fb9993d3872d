"""A training step's device memory as XLA states it at compile time, for any model size, on any
machine: the whole step (parameters, Adam's moments, the batch, the gradients and every
temporary) compiled on abstract arrays, nothing allocated (train.loop.step_bytes, the figure
the training loop checks against the device before its first step).

The Pythia-160M recipe at 16 x 2,048 needed 97.7 GiB on an H200 (a run of 2026-11-26) while the
attention scores were still materialised. Compiled for this machine's
backend: on a CPU the figure includes XLA:CPU's float32 copies of bfloat16 operands.

    python benchmarks/train_memory.py [--recipe pythia-160m] [--shapes 16x2048,8x2048]
        [--grad-accum 1,4] [--loss-chunks 0,2048] [--remat false,true] [--scan-layers false,true]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import record  # noqa: E402

from train import sharding as shd  # noqa: E402
from train.config import recipe  # noqa: E402
from train.loop import shardings_of_state, step_bytes  # noqa: E402
from train.step import compile_step, init_state  # noqa: E402


def train_step_bytes(cfg) -> tuple[int, float]:
    mesh = shd.make_mesh(0, 1)
    abstract = jax.eval_shape(lambda k: init_state(cfg, k), jax.random.key(0))
    shardings = shardings_of_state(mesh, abstract, shd.param_shardings(mesh, abstract["params"]))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, shardings)
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jax.numpy.int32,
                                 sharding=shd.batch_sharding(mesh))
    step = compile_step(cfg, shardings, shd.batch_sharding(mesh))
    t0 = time.process_time()
    compiled = step.lower(state, batch, cfg).compile()
    return step_bytes(compiled), time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="pythia-160m")
    ap.add_argument("--shapes", default="16x2048", help="BATCHxSEQ_LEN, comma-separated")
    ap.add_argument("--loss-chunks", default="0,2048",
                    help="loss_chunk values (0: the whole [tokens, vocabulary] logits at once)")
    ap.add_argument("--remat", default="false,true", help="remat values (true: recompute each "
                    "block's activations in the backward pass)")
    ap.add_argument("--grad-accum", default="1,4", help="grad_accum values")
    ap.add_argument("--scan-layers", default="false", help="scan_layers values (true: the "
                    "blocks stacked and run under one scan)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    rows = ["| batch x seq_len | grad_accum | loss_chunk | remat | scan_layers | step memory "
            "(GiB) | trace + compile (CPU s) |", "|---|---:|---:|---|---|---:|---:|"]
    for shape in a.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        for accum in (int(g) for g in a.grad_accum.split(",")):
            for chunk in (int(c) for c in a.loss_chunks.split(",")):
                for remat in a.remat.split(","):
                    for scan in a.scan_layers.split(","):
                        cfg = recipe(a.recipe, [f"batch_size={B}", f"seq_len={T}",
                                                f"grad_accum={accum}", f"loss_chunk={chunk}",
                                                f"remat={remat}", f"scan_layers={scan}"])
                        nbytes, cpu_s = train_step_bytes(cfg)
                        rows.append(f"| {B} x {T} | {accum} | {chunk} | {remat} | {scan} | "
                                    f"{nbytes / 2 ** 30:.1f} | {cpu_s:.0f} |")
                        print(rows[-1], flush=True)
    record(f"Training step memory, {a.recipe} (XLA's compile-time count, "
           f"{jax.devices()[0].platform})", "\n".join(rows), dry=a.no_record)


if __name__ == "__main__":
    main()
