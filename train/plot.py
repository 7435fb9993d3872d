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


def plot_probes(runs: dict, path: str, title: str = "sink probes") -> None:
    """``runs``: label -> run directory with ``sink_eval_every`` probes. Left: the sink metric
    (share of heads whose mean attention to token 0 exceeds 0.3) against training tokens; right:
    window (0+W) over StreamingLLM (4+W-4) perplexity on held-out text — above 1 once the model
    leans on its first tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, run in runs.items():
        probes = [r for r in read_metrics(run) if "probe" in r]
        if not probes:
            raise ValueError(f"{run} logged no sink probes (train with --set sink_eval_every=N)")
        tokens = np.array([r["tokens"] for r in probes]) / 1e6
        a1.plot(tokens, [r["probe"]["sink_metric"] for r in probes], marker="o", label=label)
        a2.plot(tokens, [r["probe"]["ppl_window"] / r["probe"]["ppl_streaming"] for r in probes],
                marker="o", label=label)
    a1.set_ylabel("sink metric (token 0, ε = 0.3)")
    a2.set_ylabel("window ppl / StreamingLLM ppl")
    a2.axhline(1.0, color="gray", lw=0.8, ls=":")
    for a in (a1, a2):
        a.set_xlabel("training tokens (millions)")
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
