"""``python -m train`` (also ``jaxllm-train``): run a recipe, plot runs' loss curves."""
from __future__ import annotations

import argparse
import json


def cmd_run(a) -> None:
    from .config import recipe
    from .loop import train
    over = list(a.set)
    for flag, key in (("sink", "sink"), ("data", "data"), ("steps", "steps"),
                      ("tokenizer", "tokenizer"), ("pose", "pose_target")):
        if getattr(a, flag) is not None:
            over.append(f"{key}={getattr(a, flag)}")
    if a.mesh:
        for part in a.mesh.split(","):
            k, _, v = part.partition("=")
            if k not in ("data", "fsdp") or not v.isdigit():
                raise ValueError(f"--mesh {a.mesh!r}: use e.g. data=2,fsdp=4")
            over.append(f"mesh_{k}={v}")
    cfg = recipe(a.preset, over)
    import dataclasses

    from jaxllm.config import Kernels  # the environment's kernel choice, read once here
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kernels=Kernels.from_env()))
    if a.print_config:
        print(json.dumps(cfg.to_dict(), indent=1))
        return
    from jaxllm.cli.common import check_files
    check_files({"--json": a.json}, [a.out])  # refused now, not after the training
    summary = train(cfg, a.out, resume=not a.no_resume, distributed=a.distributed,
                    stop_after=a.stop_after, restart=a.restart)
    if summary.get("model"):
        summary.update(_finish(a.out, cfg))
    if a.json:
        from jaxllm.outputs import write_json
        write_json(a.json, summary, [a.out])
    print(_report(a.out, summary))


def _finish(out: str, cfg) -> dict:
    """What a finished run adds to its summary: the held-out loss of the exported model and
    the loss curve's plot."""
    import os

    from .loop import heldout_loss
    from .plot import plot_loss_curves
    got = {"loss_png": os.path.join(out, "loss.png")}
    plot_loss_curves({os.path.basename(os.path.normpath(out)): out}, got["loss_png"],
                     f"{cfg.model.sink}-sink training loss")
    held = heldout_loss(out, cfg.seq_len)
    if held is not None:
        got["heldout_loss"], got["heldout_tokens"] = held
    return got


def _report(out: str, s: dict) -> str:
    """The run's summary in a few lines, ending with what to run next."""
    import math
    import shlex
    done = (f"finished {s['steps']} steps" if s["finished"] else
            f"stopped after step {s['steps']} (checkpointed: run the same command to resume)")
    lines = [f"{out}: {done}"]
    if "loss" in s:
        lines.append(f"  last logged training loss {s['loss']:.4f}, "
                     f"{s['tokens_per_s']:,.0f} tokens/s")
    if "heldout_loss" in s:
        lines.append(f"  held-out loss {s['heldout_loss']:.4f} (perplexity "
                     f"{math.exp(s['heldout_loss']):.2f}) on {s['heldout_tokens']:,} tokens")
    if "loss_png" in s:
        lines.append(f"  loss curve: {s['loss_png']}")
    if s.get("model"):
        m = shlex.quote(s["model"])
        lines += [f"  model: {s['model']}", "next:",
                  f"  jaxllm generate --model {m} --prompt 'The'",
                  f"  jaxllm ppl --model {m}   # perplexity on the embedded corpus"]
    return "\n".join(lines)


def cmd_plot(a) -> None:
    from .plot import plot_loss_curves, plot_probes
    runs = {}
    for r in a.runs:
        label, sep, path = r.partition("=")
        runs[label if sep else r] = path if sep else r
    from jaxllm.outputs import check_file
    check_file(a.out, list(runs.values()))  # not into a run read, not over a foreign file
    if a.probes:
        plot_probes(runs, a.out, a.title if a.title != "training loss" else "sink probes")
    else:
        plot_loss_curves(runs, a.out, a.title)
    print(f"wrote {a.out}")


def build_parser() -> argparse.ArgumentParser:
    from jaxllm.argtypes import COUNT
    from jaxllm.cli.common import Parser

    from .config import RECIPES
    from .data import SOURCES
    ap = Parser(prog="python -m train", description="Pre-train a model (vanilla, with a "
                "learnable sink token or with softmax-off-by-one) and plot runs' loss curves.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train a recipe (resumes the run in --out if there is one)")
    r.add_argument("--preset", default="tiny", choices=sorted(RECIPES),
                   help="training recipe (train/config.py): model, data, optimiser, steps")
    r.add_argument("--out", required=True, help="run directory")
    r.add_argument("--sink", choices=["none", "learnable", "zero"], default=None,
                   help="sink variant (None: the recipe's, vanilla for every preset)")
    r.add_argument("--data", default=None,
                   help=f"training text (None: the recipe's): {SOURCES}")
    r.add_argument("--tokenizer", default=None,
                   help="'byte' or a local HF tokenizer directory (None: the recipe's)")
    r.add_argument("--steps", type=COUNT, default=None,
                   help="optimiser steps (None: the recipe's)")
    r.add_argument("--pose", type=COUNT, default=None, metavar="LT",
                   help="PoSE: train seq_len-token samples at position ids skipping up to LT "
                        "(the authors' two chunks; --set pose_span=N: text window N x seq_len)")
    r.add_argument("--mesh", default="", help="device mesh, e.g. data=2,fsdp=4 (default: all "
                                              "devices on data)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any recipe field, e.g. lr=3e-4, grad_accum=4, "
                        "model.num_layers=8 (repeatable)")
    r.add_argument("--distributed", action="store_true",
                   help="multi-host: call jax.distributed.initialize() first")
    r.add_argument("--stop-after", type=COUNT, default=None,
                   help="stop after this step with a checkpoint (resume later)")
    r.add_argument("--no-resume", action="store_true", help="refuse to continue an existing run")
    r.add_argument("--restart", action="store_true",
                   help="a run whose checkpoints are gone: train it again from step 0 over its "
                        "metrics and model (refused without this flag)")
    r.add_argument("--print-config", action="store_true", help="print the recipe and exit")
    r.add_argument("--json", help="write the run's summary here (steps, losses, tokens/s, model)")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("plot", help="loss curves of runs on one plot (Fig. 6)")
    p.add_argument("runs", nargs="+", help="run directories, optionally LABEL=DIR")
    p.add_argument("--out", default="loss.png", help="PNG to write")
    p.add_argument("--title", default="training loss", help="plot title")
    p.add_argument("--probes", action="store_true",
                   help="plot the runs' sink probes instead (sink metric and window / "
                        "StreamingLLM perplexity against training tokens; runs trained with "
                        "--set sink_eval_every=N)")
    p.set_defaults(fn=cmd_plot)
    return ap


def parse(argv=None) -> argparse.Namespace:
    """The command line parsed and its numbers validated (jaxllm.argtypes); bad input raises
    jaxllm.cli.CliError (one line), no work done."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    from jaxllm.cli.common import run
    return run(build_parser(), argv, lambda args: "", (ValueError, FloatingPointError))
