"""Activation outliers before and after smoothing (SmoothQuant §3.2, Fig. 4; docs/METHODS.md
§2): per input channel of one linear layer, the largest |activation| and |weight|, and how
migrating the scale with ``alpha`` flattens the activation's outlier channels."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import tree
from ..config import ModelConfig
from ..smoothquant import (DEFAULT_ALPHA, CalibConfig, calibrate, calibration_windows,
                           smooth_groups, smoothing_factors)
from .common import Report


def outlier_report(params, cfg: ModelConfig, calib_tokens, layer: Optional[str] = None,
                   alpha: Optional[float] = None, calib: CalibConfig = CalibConfig(n_seqs=16,
                                                                                   seq_len=256)
                   ) -> dict:
    """Per input channel of one linear layer (default: layer 0's q), max |X_j| and max |W_j|
    before and after smoothing with ``alpha`` (SmoothQuant Fig. 4 / §3.2): smoothing divides the
    activation's outlier channels by s_j and multiplies the weight's rows by it."""
    seqs, _ = calibration_windows(np.asarray(calib_tokens, np.int32), calib, False)
    stats = calibrate(params, cfg, seqs)
    groups = smooth_groups(cfg)
    alpha = DEFAULT_ALPHA.get(cfg.family, 0.5) if alpha is None else alpha
    layer = layer or groups[0][1][0]
    group = [g for g in groups if layer in g[1]]
    if not group:
        raise ValueError(f"{layer!r} is not a smoothed linear; choose one of "
                         f"{', '.join(x for _, ls in groups for x in ls)}")
    s = smoothing_factors(params, stats, group, alpha)[group[0][0]]
    w = np.abs(np.asarray(tree.get(params, f"{layer}/kernel")))  # [in, out]
    x = stats[layer]
    rep = {"layer": layer, "alpha": alpha, "act_before": x, "act_after": x / s,
           "weight_before": w.max(1), "weight_after": (w * s[:, None]).max(1)}
    for when in ("before", "after"):  # outlier strength: the largest channel over the median
        rep[f"act_max_over_median_{when}"] = float(rep[f"act_{when}"].max()
                                                   / np.median(rep[f"act_{when}"]))
    return rep


def plot_outliers(rep: dict, path: str, title: str) -> None:
    """Activation and weight max |.| per input channel, before and after smoothing."""
    from ..plots import figure
    with figure(path, f"{title} · {rep['layer']} · alpha {rep['alpha']}", size=(10, 5.5),
                nrows=2, ncols=2, sharex=True) as axes:
        ch = np.arange(len(rep["act_before"]))
        for row, kind in enumerate(("act", "weight")):
            for col, when in enumerate(("before", "after")):
                ax = axes[row, col]
                ax.bar(ch, rep[f"{kind}_{when}"], width=1.0,
                       color="tab:red" if kind == "act" else "tab:blue")
                ax.set_title(f"{'activation' if kind == 'act' else 'weight'} max |.| per "
                             f"channel, {when} smoothing", fontsize=9)
        for ax in axes[1]:
            ax.set_xlabel("input channel")


def report(params, cfg: ModelConfig, calib_tokens, png: str, title: str,
           layer: Optional[str] = None, alpha: Optional[float] = None,
           calib: CalibConfig = CalibConfig(n_seqs=16, seq_len=256)) -> Report:
    """:func:`outlier_report` with its summary line and the figure at ``png``; the JSON result
    holds the per-channel arrays as lists."""
    rep = outlier_report(params, cfg, calib_tokens, layer, alpha, calib)
    plot_outliers(rep, png, title)
    return Report([f"{rep['layer']}: activation max/median per channel "
                   f"{rep['act_max_over_median_before']:.1f} before smoothing, "
                   f"{rep['act_max_over_median_after']:.1f} after (alpha {rep['alpha']})"],
                  {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in rep.items()})
