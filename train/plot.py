"""Loss curves of several runs on one plot (StreamingLLM Fig. 6)."""
from __future__ import annotations

import os

import numpy as np

from jaxllm.plots import figure, running_mean


def read_metrics(run_dir: str) -> list[dict]:
    """A run's logged records (lines that are not records, e.g. one torn by a kill, skipped)."""
    from .loop import metric_records
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"{run_dir} has no metrics.jsonl: is it a train run directory?")
    records = metric_records(path)[0]
    if not records:
        raise ValueError(f"{path} holds no metrics records yet: plot once the run has logged")
    return records


def plot_loss_curves(runs: dict, path: str, title: str = "training loss") -> None:
    """``runs``: label -> run directory. Raw logged loss (faint) and its running mean."""
    with figure(path, title, size=(7, 4)) as ax:
        for label, run in runs.items():
            m = read_metrics(run)
            x = np.array([r["step"] for r in m])
            y = np.array([r["loss"] for r in m])
            line, = ax.plot(x, y, lw=0.6, alpha=0.35)
            k = max(1, len(y) // 20)
            if len(y) > k:
                ax.plot(x[k - 1:], running_mean(y, k), color=line.get_color(), lw=1.6,
                        label=label)
            else:
                line.set_label(label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()


def plot_probes(runs: dict, path: str, title: str = "sink probes") -> None:
    """``runs``: label -> run directory with ``sink_eval_every`` probes. Left: the sink metric
    (share of heads whose mean attention to token 0 exceeds 0.3) against training tokens; right:
    window (0+W) over StreamingLLM (4+W-4) perplexity on held-out text — above 1 once the model
    leans on its first tokens."""
    probes = {label: [r for r in read_metrics(run) if "probe" in r] for label, run in runs.items()}
    for label, got in probes.items():
        if not got:
            raise ValueError(f"{runs[label]} logged no sink probes (train with --set "
                             f"sink_eval_every=N)")
    with figure(path, title, size=(10, 3.8), ncols=2) as (a1, a2):
        for label, got in probes.items():
            tokens = np.array([r["tokens"] for r in got]) / 1e6
            a1.plot(tokens, [r["probe"]["sink_metric"] for r in got], marker="o", label=label)
            a2.plot(tokens, [r["probe"]["ppl_window"] / r["probe"]["ppl_streaming"]
                             for r in got], marker="o", label=label)
        a1.set_ylabel("sink metric (token 0, ε = 0.3)")
        a2.set_ylabel("window ppl / StreamingLLM ppl")
        a2.axhline(1.0, color="gray", lw=0.8, ls=":")
        for a in (a1, a2):
            a.set_xlabel("training tokens (millions)")
            a.legend(fontsize=8)
