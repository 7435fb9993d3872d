"""Attention shift under KV quantization (Q-Hitter, Zhang et al. 2024, Table 1 and Fig. 2-3).

Quantizing keys changes the attention a model pays, so the heavy hitters H2O would keep from a
quantized cache are not those of the float cache. For one text fed as a prompt, per layer:

* the accumulated attention of every token (column sums of the causal attention, summed over a
  KV head's query heads: jaxllm.kv.evict's score) with float keys and values and with k-bit ones;
* the heavy-hitter set H2O's prefill keeps from each (top ``heavy`` among all but the last
  ``recent`` tokens, per KV head) and the overlap of the k-bit set with the float one;
* each token's quantization error (L2 of the key's and the value's, averaged), and its rank
  correlation with the accumulated attention (Fig. 3: are heavy hitters hard to quantize?);
* the streamed perplexity of H2O with the float cache and with each k-bit cache (the sets in use).

The scores come from the model's own score-based cache: a prompt through an H2O cache large
enough to keep everything attends fully and evicts nothing, so its per-slot scores are exactly the
column sums of the prompt's attention, computed on the keys and values as stored.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..kv.evict import Evict
from ..kv.quantized import KVQuant
from ..policy import H2O, KVStorage
from .common import Report


def _scores(params, cfg: ModelConfig, ids: np.ndarray, kv: KVQuant):
    """(acc, err) per layer, each [KVH, T]: accumulated attention and the mean L2 quantization
    error of each token's key and value (zeros for the float cache)."""
    from .. import forward, init_cache
    T = len(ids)
    spec = Evict("qhitter", heavy=T, recent=1, lam=0.5)  # keeps all; stores the errors
    cache = init_cache(cfg, 1, sinks=0, evict_by=spec, kv_quant=kv)
    _, cache = forward(params, cfg, np.asarray(ids, np.int32)[None], cache)
    # nothing is evicted, so slot i holds token i
    return [(np.asarray(s.acc)[0, :, :T], np.asarray(s.err)[0, :, :T].mean(-1))
            for s in cache.state]


def _heavy_set(acc: np.ndarray, heavy: int, recent: int) -> list:
    """Per KV head, the tokens H2O's prefill keeps as heavy hitters."""
    T = acc.shape[1]
    return [set(np.argsort(-a[:T - recent], kind="stable")[:heavy].tolist()) for a in acc]


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def kv_shift(params, cfg: ModelConfig, ids, bits=(8, 4, 3, 2), prompt: int = 512,
             heavy: float = 0.1, recent: float = 0.1, stream: int = 2048) -> dict:
    """The attention-shift report for the first ``prompt`` tokens of ``ids`` (sets) and the
    first ``stream`` (perplexity); ``heavy``/``recent``: fractions of the text, H2O's 10% + 10%."""
    from ..ppl import stream_nll
    ids = np.asarray(ids, np.int32)
    if len(ids) < max(prompt, stream, 16):
        raise ValueError(f"kv-shift needs {max(prompt, stream)} tokens of text, got {len(ids)}")
    if not (0 < heavy < 1 and 0 < recent < 1 and heavy + recent < 1):
        raise ValueError(f"heavy and recent are fractions in (0, 1) summing below 1, got "
                         f"{heavy} and {recent}")
    H, R = max(1, int(heavy * prompt)), max(1, int(recent * prompt))
    specs = {"float": KVQuant(), **{f"{b}-bit": KVQuant("token", bits=b, group=0) for b in bits}}
    scores = {name: _scores(params, cfg, ids[:prompt], kv) for name, kv in specs.items()}
    ref_sets = [_heavy_set(acc, H, R) for acc, _ in scores["float"]]
    layers = []
    for li in range(cfg.num_layers):
        row = {"layer": li}
        for name in specs:
            if name == "float":
                continue
            acc, err = scores[name][li]
            sets = _heavy_set(acc, H, R)
            row[f"overlap_{name}"] = float(np.mean([len(a & b) / H for a, b in
                                                    zip(sets, ref_sets[li])]))
            row[f"spearman_{name}"] = _spearman(acc[:, :prompt - R].ravel(),
                                                err[:, :prompt - R].ravel())
        layers.append(row)
    ppl = {}
    for name, kv in specs.items():
        pc = H2O(heavy=heavy, recent=recent, storage=KVStorage(quant=kv)).resolve(stream)
        ppl[name] = float(np.exp(stream_nll(params, cfg, ids[:stream], pc).astype(
            np.float64).mean()))
    worst = min(bits)
    acc, err = scores[f"{worst}-bit"][0]
    return {"prompt_tokens": prompt, "stream_tokens": stream, "heavy": H, "recent": R,
            "bits": list(bits), "layers": layers, "h2o_ppl": ppl,
            "scatter": {"bits": worst, "layer": 0, "acc": acc[:, :prompt - R].ravel().tolist(),
                        "err": err[:, :prompt - R].ravel().tolist()}}


def plot_kv_shift(rep: dict, path: str, title: str) -> None:
    """Left: overlap of the k-bit heavy hitters with the float ones per layer. Right: layer 0's
    accumulated attention against quantization error at the lowest bit width."""
    from ..plots import figure
    with figure(path, title, size=(10, 4), ncols=2) as (a1, a2):
        x = [r["layer"] for r in rep["layers"]]
        for b in rep["bits"]:
            a1.plot(x, [r[f"overlap_{b}-bit"] for r in rep["layers"]], marker="o",
                    label=f"{b}-bit (H2O ppl {rep['h2o_ppl'][f'{b}-bit']:.2f})")
        a1.set_xlabel("layer")
        a1.set_ylabel("heavy-hitter overlap with float")
        a1.set_ylim(0, 1.05)
        a1.legend(title=f"float H2O ppl {rep['h2o_ppl']['float']:.2f}", fontsize=8)
        s = rep["scatter"]
        a2.scatter(s["acc"], s["err"], s=4, alpha=0.4)
        a2.set_xscale("log")
        a2.set_xlabel("accumulated attention (layer 0)")
        a2.set_ylabel(f"{s['bits']}-bit quantization error (L2)")


def report(params, cfg: ModelConfig, ids, png: str, title: str, bits=(8, 4, 3, 2),
           prompt: int = 512, heavy: float = 0.1, recent: float = 0.1,
           stream: int = 2048) -> Report:
    """:func:`kv_shift` with a line per layer and the figure at ``png``."""
    rep = kv_shift(params, cfg, ids, bits, prompt, heavy, recent, stream)
    worst = min(bits)
    lines = [f"layer {r['layer']}: overlap with float " + ", ".join(
        f"{b}-bit {r[f'overlap_{b}-bit']:.2f}" for b in bits) +
        f"; attention vs {worst}-bit error, Spearman {r[f'spearman_{worst}-bit']:+.2f}"
        for r in rep["layers"]]
    lines.append("H2O ppl: " + ", ".join(f"{k} {v:.3f}" for k, v in rep["h2o_ppl"].items()))
    plot_kv_shift(rep, png, f"{title}: heavy hitters under KV quantization")
    return Report(lines, rep)
