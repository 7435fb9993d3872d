"""Loss curves of several runs on one plot (StreamingLLM Fig. 6)."""
from __future__ import annotations

import json
import os

import numpy as np


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"{run_dir} has no metrics.jsonl: is it a train run directory?")
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def plot_loss_curves(runs: dict, path: str, title: str = "training loss") -> None:
    """``runs``: label -> run directory. Raw logged loss (faint) and its running mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in runs.items():
        m = read_metrics(run)
        x = np.array([r["step"] for r in m])
        y = np.array([r["loss"] for r in m])
        line, = ax.plot(x, y, lw=0.6, alpha=0.35)
        k = max(1, len(y) // 20)
        if len(y) > k:
            ax.plot(x[k - 1:], np.convolve(y, np.ones(k) / k, "valid"), color=line.get_color(),
                    lw=1.6, label=label)
        else:
            line.set_label(label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
