"""The sink-token experiment (StreamingLLM §3.3, docs/METHODS.md §2): vanilla, zero-sink and
learnable-sink models trained under identical settings, then

* streaming perplexity on held-out text with caches 0+W, 1+(W-1), 2+(W-2), 4+(W-4) (Table 3),
  plus the sliding-window-with-recompute oracle;
* the loss curves of the three runs (Fig. 6);
* head-averaged attention maps per layer (Fig. 7) and the sink metric per layer.

    python -m train.experiments.sink_token --preset tiny --out runs/sink_tiny

Each variant trains into OUT/{none,zero,learnable}; a finished run is not retrained (an
interrupted one resumes). Results: OUT/results.json, OUT/table.md, OUT/loss.png,
OUT/attention_{variant}.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import numpy as np

VARIANTS = ("none", "zero", "learnable")


def evaluate(out: str, window: int, eval_tokens: int, progress: bool = True) -> dict:
    """Table 3 and the sink analysis on each variant's exported model and held-out text."""
    from jaxllm.evals.attention import attention_maps, plot_maps, sink_metric
    from jaxllm.io import load_model
    from jaxllm.policy import Recompute, StreamingLLM, Window
    from jaxllm.ppl import stream_score

    from train.config import TrainConfig
    from train.loop import heldout_text
    from train.plot import read_metrics
    results = {"window": window, "eval_tokens": eval_tokens, "variants": {}}
    for v in VARIANTS:
        run = os.path.join(out, v)
        with open(os.path.join(run, "train_config.json")) as f:
            tc = TrainConfig.from_dict(json.load(f))
        cfg, params, _ = load_model(os.path.join(run, "model"))
        text = heldout_text(run, eval_tokens)
        row = {}
        for s in (0, 1, 2, 4):
            pc = Window(window) if s == 0 else StreamingLLM(s, window)
            nll = stream_score(params, cfg, text, pc, progress, desc=f"{v} {s}+{window - s}")[0]
            row[f"{s}+{window - s}"] = float(np.exp(nll.astype(np.float64).mean()))
        nll = stream_score(params, cfg, text, Recompute(4, window), progress,
                           desc=f"{v} recompute")[0]
        row["recompute 4+"] = float(np.exp(nll.astype(np.float64).mean()))
        L = tc.seq_len
        maps = attention_maps(params, cfg, heldout_text(run, 8 * L).reshape(8, L))
        plot_maps(maps, os.path.join(out, f"attention_{v}.png"),
                  f"{v}-sink model: head-averaged attention, first 16 tokens")
        metrics = read_metrics(run)
        results["variants"][v] = {"ppl": row, "sink_metric": sink_metric(maps),
                                  "final_loss": metrics[-1]["loss"],
                                  "probes": [{"step": m["step"], **m["probe"]} for m in metrics
                                             if "probe" in m]}
    return results


def train_parallel(base, out: str, child_args: list[str], poll_s: float = 30.0) -> dict:
    """Train every variant in its own process at once, sharing the accelerator: each gets an
    equal share of device memory (unless XLA_PYTHON_CLIENT_MEM_FRACTION is set) and logs to
    OUT/VARIANT/train.log; a status line per variant is printed every ``poll_s`` seconds.
    Returns each variant's wall-clock seconds; raises if any variant fails."""
    import subprocess

    from jaxllm.tokenizer import load_tokenizer
    from train import data as data_lib
    # Tokenize once here, so the children memory-map one cache instead of each building it.
    data_lib.tokenize(base.data, load_tokenizer(base.tokenizer), os.path.join(out, ".token_cache"),
                      progress=True)
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / len(VARIANTS):.2f}")
    procs, logs, t0, times = {}, {}, time.perf_counter(), {}
    from jaxllm.outputs import claim_run_dir
    from train.loop import _legacy_run
    for v in VARIANTS:
        claim_run_dir(os.path.join(out, v), legacy=_legacy_run)  # before its log goes in
        logs[v] = open(os.path.join(out, v, "train.log"), "a")
        procs[v] = subprocess.Popen(
            [sys.executable, "-m", "train.experiments.sink_token", *child_args, "--variant", v],
            stdout=logs[v], stderr=subprocess.STDOUT, env=env)
    print(f"== training {', '.join(VARIANTS)} at once into {out}/VARIANT (logs: train.log)")
    try:
        last_print = time.perf_counter()
        while procs:
            time.sleep(1.0)
            for v, p in list(procs.items()):
                if p.poll() is not None:
                    times[v] = time.perf_counter() - t0
                    del procs[v]
                    if p.returncode:
                        raise RuntimeError(f"training the {v} variant failed (exit {p.returncode});"
                                           f" see {os.path.join(out, v, 'train.log')}")
            if time.perf_counter() - last_print >= poll_s or not procs:
                last_print = time.perf_counter()
                print(f"[{last_print - t0:6.0f} s] " + " | ".join(
                    f"{v}: {_status(os.path.join(out, v))}" for v in VARIANTS), flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for f in logs.values():
            f.close()
    return times


def _status(run: str) -> str:
    """The latest logged step of a run, in a few words."""
    try:
        from train.plot import read_metrics
        logged = read_metrics(run)
        last = logged[-1]
    except (OSError, IndexError, ValueError):
        return "starting"
    probe = next((m["probe"] for m in reversed(logged) if "probe" in m), {})
    sink = f" sink {probe['sink_metric']:.2f}" if probe else ""
    return f"step {last['step']} loss {last['loss']:.3f} {last['tokens_per_s']:,.0f} tok/s{sink}"


def table(results: dict) -> str:
    W = results["window"]
    cols = [f"{s}+{W - s}" for s in (0, 1, 2, 4)] + ["recompute 4+"]
    lines = ["| model | " + " | ".join(cols) + " | sink metric (token 0) | final train loss |",
             "|---" * (len(cols) + 3) + "|"]
    names = {"none": "Vanilla", "zero": "Zero Sink", "learnable": "Learnable Sink"}
    for v, r in results["variants"].items():
        lines.append(f"| {names[v]} | " + " | ".join(f"{r['ppl'][c]:.2f}" for c in cols)
                     + f" | {r['sink_metric']['overall']:.2f} "
                       f"({', '.join(f'{x:.2f}' for x in r['sink_metric']['per_layer'])}) | "
                       f"{r['final_loss']:.3f} |")
    return "\n".join(lines)


def ship(out: str, dest: str, results: dict, command: str) -> None:
    """The vanilla and learnable-sink models into ``dest`` (atomically, each), with a README
    that says how they were made and what they measure."""
    from jaxllm.io import atomic_dir
    for v, name in (("none", "vanilla"), ("learnable", "learnable-sink")):
        with atomic_dir(os.path.join(dest, name), overwrite=True) as tmp:
            src = os.path.join(out, v, "model")
            for f in os.listdir(src):
                shutil.copy2(os.path.join(src, f), os.path.join(tmp, f))
    with open(os.path.join(dest, "README.md"), "w") as f:
        f.write(f"# Embedded models\n\nTrained by jaxllm's `train` package; regenerate with\n\n"
                f"```bash\n{command}\n```\n\n(`make embedded-model`). `vanilla` is the default "
                f"`--model` of every command (`embedded`); `learnable-sink` (`embedded-sink`) is its "
                f"twin trained with a learnable sink token. Streaming perplexity on held-out "
                f"text, cache {results['window']} (the paper's Table 3 layout):\n\n"
                f"{table(results)}\n")
    print(f"shipped the models to {dest}")


def build_parser():
    from jaxllm.argtypes import SIZE
    from jaxllm.cli.common import Parser
    ap = Parser(prog="python -m train.experiments.sink_token",
                description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--preset", default="tiny", help="training recipe (train.config.RECIPES)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe field (repeatable), e.g. steps=500 or "
                         "model.num_layers=4")
    ap.add_argument("--out", default=None, help="experiment directory (default runs/sink_PRESET)")
    ap.add_argument("--window", type=SIZE, default=0,
                    help="cache size W for the table (default: half the training context)")
    ap.add_argument("--eval-tokens", type=SIZE, default=0,
                    help="held-out tokens streamed per cell (default: 8 training contexts)")
    ap.add_argument("--eval-only", action="store_true", help="only evaluate finished runs")
    ap.add_argument("--ship", metavar="DIR", default=None,
                    help="copy the vanilla and learnable-sink models to DIR/vanilla and "
                         "DIR/learnable-sink (how jaxllm/models is made)")
    ap.add_argument("--parallel", action="store_true",
                    help="train the three variants at once, one process each, sharing the "
                         "accelerator (a small model alone leaves most of a GPU idle)")
    ap.add_argument("--train-only", action="store_true",
                    help="train (or resume) the variants, then stop without evaluating")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # --parallel's child
    return ap


def main(argv=None) -> int:
    from train.config import recipe
    from train.loop import train
    from train.plot import plot_loss_curves
    from jaxllm.cli.common import CliError
    try:
        a = build_parser().parse_args(argv)
    except CliError as e:
        print(e, file=sys.stderr)
        return 2
    out = a.out or os.path.join("runs", f"sink_{a.preset}")
    base = recipe(a.preset, a.set)
    cache_dir = os.path.join(out, ".token_cache")
    if a.variant:  # one variant, quietly: the parent reports progress
        train(dataclasses.replace(base, sink=a.variant), os.path.join(out, a.variant),
              progress=False, cache_dir=cache_dir)
        return 0
    times = {}
    if not a.eval_only:
        if a.parallel:
            child = ["--preset", a.preset, "--out", out] + [x for o in a.set for x in ("--set", o)]
            times = train_parallel(base, out, child)
        else:
            for v in VARIANTS:
                t0 = time.perf_counter()
                print(f"== training {v}-sink ({a.preset}) into {os.path.join(out, v)}")
                train(dataclasses.replace(base, sink=v), os.path.join(out, v),
                      cache_dir=cache_dir)
                times[v] = time.perf_counter() - t0
    if a.train_only:
        return 0
    W = a.window or base.seq_len // 2
    results = evaluate(out, W, a.eval_tokens or 8 * base.seq_len)
    old = os.path.join(out, "results.json")
    if not times and os.path.exists(old):  # --eval-only keeps the training times measured before
        with open(old) as f:
            times = json.load(f).get("train_seconds", {})
    results.update(preset=a.preset, overrides=a.set, train_seconds=times)
    plot_loss_curves({v: os.path.join(out, v) for v in VARIANTS}, os.path.join(out, "loss.png"),
                     f"{a.preset}: training loss by sink variant")
    from jaxllm.outputs import write_json, write_text
    write_json(os.path.join(out, "results.json"), results)
    md = table(results)
    write_text(os.path.join(out, "table.md"), md + "\n")
    print(md)
    print(f"wrote {out}/results.json, table.md, loss.png, attention_*.png")
    if a.ship:
        ship(out, a.ship, results, " ".join(["python -m train.experiments.sink_token"]
                                             + (argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
