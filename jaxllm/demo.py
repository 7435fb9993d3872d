"""``jaxllm demo``: the main job on the embedded models, in one command.

Streams the embedded corpus through dense, window, StreamingLLM and sliding-window-with-recompute
caches (and StreamingLLM on a SmoothQuant INT8 copy), prints perplexity, tokens/s and peak
memory per method, plots running NLL against position (StreamingLLM Fig. 3) and continues a
prompt with a StreamingLLM cache smaller than the prompt.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from .ppl import PplConfig, peak_rss_mb, stream_score


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    tokens: int = 4096  # stream length (the embedded models were trained on 256-token samples)
    cache: int = 128  # sinks + window for window / streaming / recompute
    sinks: int = 4
    int8: bool = True  # also StreamingLLM on a SmoothQuant O1 copy
    prompt: str = "The with statement is used to"
    new_tokens: int = 160
    temperature: float = 0.7  # sampled (top-k 40, fixed seed): greedy decoding of a small
    top_k: int = 40           # byte model loops on one phrase


def _run(params, cfg, ids, pc: PplConfig, desc: str) -> tuple[np.ndarray, dict]:
    # Compile first, so the stream alone is timed (a dense cache's shape is the stream's length,
    # so only the whole stream compiles the same program).
    stream_score(params, cfg, ids if pc.method == "dense" else ids[:2 * pc.cache + 2], pc)
    t0 = time.perf_counter()
    nll = stream_score(params, cfg, ids, pc, True, desc)[0]
    secs = time.perf_counter() - t0
    # K/V held for the longest context (dense: the whole stream; the others: the cache; the
    # recompute baseline rebuilds that much for every token), float32.
    slots = len(ids) + 1 if pc.method == "dense" else pc.cache
    kv = 2 * cfg.num_layers * slots * cfg.num_kv_heads * cfg.head_dim * 4 / 2 ** 20
    return nll, {"ppl": float(np.exp(nll.astype(np.float64).mean())),
                 "tokens_per_s": len(nll) / secs, "kv_mib": kv, "peak_rss_mb": peak_rss_mb()}


def run_demo(models: dict, ids: np.ndarray, calib_ids: np.ndarray, dc: DemoConfig,
             out_dir: str) -> dict:
    """``models``: label -> (cfg, params, tokenizer); ``ids`` the stream, ``calib_ids`` other
    text for SmoothQuant's calibration. Returns (and writes) the results."""
    from .cache import init_cache
    from .generate import SamplingConfig, generate
    os.makedirs(out_dir, exist_ok=True)
    S, C = dc.sinks, dc.cache
    rows, curves = [], {}
    for label, (cfg, params, tok) in models.items():
        plans = [("dense", PplConfig("dense", 0, C)), (f"window 0+{C}", PplConfig("window", 0, C)),
                 (f"StreamingLLM {S}+{C - S}", PplConfig("streaming", S, C)),
                 (f"recompute {S}+{C - S}", PplConfig("recompute", S, C))]
        for name, pc in plans:
            nll, r = _run(params, cfg, ids, pc, f"{label}: {name}")
            rows.append({"model": label, "method": name, **r})
            curves[f"{label}: {name}"] = nll
        if dc.int8:
            from .smoothquant import CalibConfig, quantize
            q = quantize(params, cfg, calib_ids, "o1", calib=CalibConfig(n_seqs=32, seq_len=256,
                                                                   heldout_seqs=0))
            nll, r = _run(q, cfg, ids, PplConfig("streaming", S, C), f"{label}: INT8 streaming")
            rows.append({"model": label, "method": f"StreamingLLM {S}+{C - S}, INT8 O1", **r})
            curves[f"{label}: INT8 StreamingLLM"] = nll
    gens = {}
    for label, (cfg, params, tok) in models.items():
        cache = init_cache(cfg, 1, sinks=S, window=min(64, C) - S)
        prompt = np.asarray([tok.encode(dc.prompt)], np.int32)
        res = generate(params, cfg, prompt, cache, SamplingConfig(
            max_new_tokens=dc.new_tokens, temperature=dc.temperature, top_k=dc.top_k),
            jax.random.key(0))
        gens[label] = tok.decode(list(np.asarray(res.tokens[0, :int(res.num_tokens[0])])))
    result = {"config": dataclasses.asdict(dc), "tokens_scored": int(len(ids) - 1),
              "rows": rows, "generations": gens}
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_curves(curves, os.path.join(out_dir, "demo.png"), dc)
    return result


def plot_curves(curves: dict, path: str, dc: DemoConfig, smooth: int = 128) -> None:
    """Running-mean NLL against position, one panel per model ("model: method" keys; keys
    without a model go in one panel), one line per method (StreamingLLM Fig. 3)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict = {}
    for name, nll in curves.items():
        model, sep, method = name.partition(": ")
        panels.setdefault(model if sep else "", {})[method if sep else name] = nll
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False,
                             sharey=True)
    for ax, (model, lines) in zip(axes[0], panels.items()):
        for method, nll in lines.items():
            k = min(smooth, len(nll))
            y = np.convolve(nll, np.ones(k) / k, "valid")
            ax.plot(np.arange(k, len(nll) + 1), y, lw=1.3, label=method,
                    ls="--" if "recompute" in method else "-")
        ax.axvline(dc.cache, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("position in stream (tokens)")
        ax.set_title(model or "cache policies", fontsize=10)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"NLL, mean of the last {smooth} tokens")
    fig.suptitle(f"the embedded corpus through each cache policy (dotted: cache size "
                 f"{dc.cache}, the first eviction)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    lines = [f"{'model':<15} {'method':<32} {'ppl':>9} {'tok/s':>8} {'KV MiB':>7} "
             f"{'peak RSS MiB':>12}"]
    for r in result["rows"]:
        lines.append(f"{r['model']:<15} {r['method']:<32} {r['ppl']:>9.3f} "
                     f"{r['tokens_per_s']:>8.0f} {r['kv_mib']:>7.2f} {r['peak_rss_mb']:>12.0f}")
    return "\n".join(lines)
