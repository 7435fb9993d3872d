"""Passkey retrieval (Mohtashami & Jaggi 2023; docs/METHODS.md §6): a 5-digit key hidden at a given
depth of repeated filler, asked for at the end. One stream per trial. The layout is the one the
PoSE authors' eval_passkey.py uses: the task, filler, the key line, filler, the question."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..config import ModelConfig
from ..policy import CachePolicy
from .common import Report, Task, build, policy_result, score_task

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there. ")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
KEY = "The pass key is {k}. Remember it. {k} is the pass key. "
ASK = "What is the pass key? The pass key is "


def passkey_task(n_tokens: int, depth: float, key: str, encode) -> Task:
    """About ``n_tokens`` tokens of filler with the key sentence at ``depth`` (0 = start,
    1 = just before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if not (len(key) == 5 and key.isdigit()):
        raise ValueError(f"the pass key is 5 digits, got {key!r}")
    per = max(1, len(encode(FILLER)))
    fixed = len(encode(TASK + KEY.format(k=key) + ASK)) + len(encode(key))
    n_fill = max(0, (n_tokens - fixed) // per)
    before = round(n_fill * depth)
    segments = [(TASK + FILLER * before + KEY.format(k=key) + FILLER * (n_fill - before) + ASK,
                 False, {}),
                (key, True, {"depth": depth, "tokens": n_tokens})]
    return build(segments, encode)


def passkey_grid(params, cfg: ModelConfig, encode, pc: CachePolicy, lengths: Sequence[int],
                 depths: Sequence[float], trials: int = 5, seed: int = 0,
                 report: Optional[Callable[[int, float, float], None]] = None,
                 chunk: int = 256) -> np.ndarray:
    """Accuracy [len(lengths), len(depths)]: the share of ``trials`` random keys retrieved at
    each stream length and key depth (one stream per trial). ``report(n, depth, acc)`` is called
    after each cell (progress)."""
    rng = np.random.default_rng(seed)
    grid = np.zeros((len(lengths), len(depths)))
    for i, n in enumerate(lengths):
        for j, d in enumerate(depths):
            keys = [f"{k:05d}" for k in rng.integers(0, 100_000, trials)]
            grid[i, j] = np.mean([score_task(params, cfg, passkey_task(n, d, k, encode), pc,
                                             chunk=chunk)[0] for k in keys])
            if report:
                report(n, d, grid[i, j])
    return grid


def plot_heatmap(grid, lengths, depths, path: str, title: str) -> None:
    """Accuracy by stream length (rows) and key depth (columns)."""
    from ..plots import figure
    with figure(path, title, size=(1.1 * len(depths) + 2, 0.5 * len(lengths) + 1.6)) as ax:
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("key depth")
        ax.set_ylabel("stream length (tokens)")
        for i in range(len(lengths)):
            for j in range(len(depths)):
                ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
        ax.figure.colorbar(im, ax=ax, label="accuracy")


def report(params, cfg: ModelConfig, encode, pc: CachePolicy, png: str, title: str,
           lengths: Sequence[int], depths: Sequence[float], trials: int = 5, seed: int = 0,
           on_cell: Optional[Callable[[int, float, float], None]] = None,
           chunk: int = 256) -> Report:
    """Passkey retrieval through ``pc`` by stream length and key depth, the heatmap at ``png``."""
    grid = passkey_grid(params, cfg, encode, pc, lengths, depths, trials, seed, on_cell, chunk)
    plot_heatmap(grid, lengths, depths, png, f"{title} · passkey · {pc.label}")
    return Report([f"passkey {pc.label}: mean accuracy {grid.mean():.3f}"],
                  dict(policy_result(pc), lengths=list(lengths), depths=list(depths),
                       trials=trials, accuracy=grid.tolist(), mean=float(grid.mean())))
