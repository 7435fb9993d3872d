"""Attention sinks in a model's own attention maps (StreamingLLM Fig. 2 and 7; docs/METHODS.md §2).

The sink metric (Gu et al., "When Attention Sink Emerges"): for layer l and head h,
α(l, h) = mean over queries t >= k of the attention from t to token k; the metric is the share of
(layer, head) pairs with α > ε (ε = 0.3), reported per layer and overall, for k = 0 by default.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..model import apply
from ..positions import with_sink
from .common import Report


@functools.partial(jax.jit, static_argnames=("cfg",))
def _maps(params, cfg: ModelConfig, tokens):
    _, _, state = apply(params, cfg, tokens, mutable=["attention"])
    inter = state["attention"]
    # [L, B, H, T, T] -> mean over the batch
    return jnp.stack([inter[f"layer_{i}"]["attn"]["probs"].mean(0)
                      for i in range(cfg.num_layers)])


def attention_maps(params, cfg: ModelConfig, seqs: np.ndarray, batch: int = 4) -> np.ndarray:
    """Attention probabilities [layers, heads, T, T] averaged over the sequences [N, T]. A
    learnable-sink model reads each row with its sink token first (as it was trained and as it
    streams), the row's last token dropping off so T stays."""
    seqs = with_sink(cfg, np.asarray(seqs, np.int32), keep_length=True)
    total = None
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        m = np.asarray(_maps(params, cfg, jnp.asarray(chunk))) * len(chunk)
        total = m if total is None else total + m
    return total / len(seqs)


def sink_report(params, cfg: ModelConfig, ids, n: int, seq_len: int, eps: float = 0.3,
                seed: int = 0) -> tuple[np.ndarray, dict]:
    """Attention maps averaged over ``n`` random ``seq_len``-token windows of ``ids`` and
    their sink metric for token 0: ``(maps, {"overall", "per_layer", ..., "n", "seq_len"})``."""
    ids = np.asarray(ids, np.int32)
    if len(ids) < n * seq_len:
        raise ValueError(f"the corpus has {len(ids)} tokens; --n x --seq-len needs {n * seq_len}")
    starts = np.random.default_rng(seed).integers(0, len(ids) - seq_len, n)
    maps = attention_maps(params, cfg, np.stack([ids[s:s + seq_len] for s in starts]))
    return maps, dict(sink_metric(maps, 0, eps), n=n, seq_len=seq_len)


def head_attention_to(maps: np.ndarray, k: int = 0) -> np.ndarray:
    """α(l, h): mean attention to token k over the queries that can see it, [layers, heads]."""
    return maps[:, :, k:, k].mean(-1)


def sink_metric(maps: np.ndarray, k: int = 0, eps: float = 0.3) -> dict:
    """Share of (layer, head) pairs whose mean attention to token k exceeds ``eps``."""
    alpha = head_attention_to(maps, k)
    per_layer = (alpha > eps).mean(1)
    return {"token": k, "eps": eps, "overall": float((alpha > eps).mean()),
            "per_layer": [float(x) for x in per_layer],
            "mean_attention_per_layer": [float(x) for x in alpha.mean(1)]}


def plot_maps(maps: np.ndarray, path: str, title: str, n: int = 16) -> None:
    """The head-averaged attention map of each layer over the first ``n`` tokens (Fig. 2)."""
    from ..plots import figure
    L = maps.shape[0]
    cols = min(L, 6)
    rows = -(-L // cols)
    with figure(path, title, size=(2.4 * cols, 2.4 * rows + 0.4), nrows=rows, ncols=cols,
                squeeze=False) as axes:
        for i, ax in enumerate(axes.flat):
            if i >= L:
                ax.axis("off")
                continue
            ax.imshow(maps[i, :, :n, :n].mean(0), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {i}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])


def report(params, cfg: ModelConfig, ids, png: str, title: str, n: int = 16, seq_len: int = 256,
           eps: float = 0.3, seed: int = 0) -> Report:
    """The sink metric of ``n`` random ``seq_len``-token windows of ``ids`` per layer, and their
    attention over the first 16 tokens plotted at ``png``."""
    maps, result = sink_report(params, cfg, ids, n, seq_len, eps, seed)
    plot_maps(maps, png, f"{title}: attention over the first 16 tokens, sink metric "
                         f"{result['overall']:.2f}")
    return Report([f"sink metric (share of heads with mean attention to token 0 > {eps}): "
                   f"{result['overall']:.2f}; per layer "
                   + " ".join(f"{x:.2f}" for x in result["per_layer"])], result)
