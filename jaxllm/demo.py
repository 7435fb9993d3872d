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
from typing import Optional

import jax
import numpy as np

from .kvquant import KVQuant
from .policy import CachePolicy
from .ppl import stream_score


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
    kv_quant: KVQuant = KVQuant()  # enabled: one more row, StreamingLLM with this KV storage

    def policies(self) -> list[CachePolicy]:
        """The rows of the table: dense, window, StreamingLLM and recompute."""
        S, C = self.sinks, self.cache
        return [CachePolicy("dense", 0, C), CachePolicy("window", 0, C),
                CachePolicy("streaming", S, C), CachePolicy("recompute", S, C)]

    @property
    def generation_policy(self) -> CachePolicy:
        """The cache the sample continuation streams through (smaller than its prompt)."""
        return CachePolicy("streaming", self.sinks, min(64, self.cache))


def _run(params, cfg, ids, pc: CachePolicy, desc: str) -> tuple[np.ndarray, dict]:
    # Compile first, so the stream alone is timed (a dense cache's shape is the stream's length,
    # so only the whole stream compiles the same program).
    stream_score(params, cfg, ids if pc.method == "dense" else ids[:2 * pc.cache + 2], pc)
    t0 = time.perf_counter()
    nll = stream_score(params, cfg, ids, pc, True, desc)[0]
    secs = time.perf_counter() - t0
    # K/V held for the longest context (dense: the whole stream; the others: the cache, its
    # codes, scales and float sinks when quantized; the recompute baseline rebuilds that much
    # for every token, float32), from the arrays' shapes.
    slots = len(ids) + 1 if pc.method == "dense" else pc.cache
    held = CachePolicy("dense", 0, slots, kv_quant=pc.kv_quant) if pc.method == "recompute" \
        else pc
    shapes = jax.eval_shape(lambda: held.make_cache(cfg, 1, slots))
    kv = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((shapes.k, shapes.v))) / 2 ** 20
    return nll, {"ppl": float(np.exp(nll.astype(np.float64).mean())),
                 "tokens_per_s": len(nll) / secs, "kv_mib": kv}


def run_demo(models: dict, ids: np.ndarray, calib_ids: np.ndarray, dc: DemoConfig,
             out_dir: str) -> dict:
    """``models``: label -> (cfg, params, tokenizer); ``ids`` the stream, ``calib_ids`` other
    text for SmoothQuant's calibration. Returns (and writes) the results."""
    from .generate import SamplingConfig, generate
    os.makedirs(out_dir, exist_ok=True)
    rows, curves, contexts = [], {}, {}
    for label, (cfg, params, tok) in models.items():
        contexts[label] = cfg.max_seq_len
        for pc in dc.policies():
            nll, r = _run(params, cfg, ids, pc, f"{label}: {pc.label}")
            rows.append({"model": label, "method": pc.label, **r})
            curves[f"{label}: {pc.label}"] = nll
        if dc.kv_quant.enabled:
            pc = dataclasses.replace(dc.policies()[2], kv_quant=dc.kv_quant)
            nll, r = _run(params, cfg, ids, pc, f"{label}: {pc.label}")
            rows.append({"model": label, "method": pc.label, **r})
            curves[f"{label}: {pc.label}"] = nll
        if dc.int8:
            from .smoothquant import CalibConfig, quantize
            q = quantize(params, cfg, calib_ids, "o1", calib=CalibConfig(n_seqs=32, seq_len=256,
                                                                   heldout_seqs=0))
            pc = dc.policies()[2]
            nll, r = _run(q, cfg, ids, pc, f"{label}: INT8 streaming")
            rows.append({"model": label, "method": f"{pc.label}, INT8 O1", **r})
            curves[f"{label}: INT8 StreamingLLM"] = nll
    gens = {}
    for label, (cfg, params, tok) in models.items():
        cache = dc.generation_policy.make_cache(cfg, 1, 0)
        prompt = np.asarray([tok.encode(dc.prompt)], np.int32)
        res = generate(params, cfg, prompt, cache, SamplingConfig(
            max_new_tokens=dc.new_tokens, temperature=dc.temperature, top_k=dc.top_k),
            jax.random.key(0))
        gens[label] = tok.decode(list(np.asarray(res.tokens[0, :int(res.num_tokens[0])])))
    unit = "byte" if all(type(t).__name__ == "ByteTokenizer" for _, _, t in models.values()) \
        else "token"
    config = dict(dataclasses.asdict(dc), kv_quant=dataclasses.asdict(dc.kv_quant))
    result = {"config": config, "tokens_scored": int(len(ids) - 1),
              "unit": unit, "training_context": contexts, "rows": rows, "generations": gens,
              # the per-position NLL (nats) that demo.png plots, one list per model and method
              "curves": {k: [round(float(x), 4) for x in v] for k, v in curves.items()}}
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_curves(curves, os.path.join(out_dir, "demo.png"), dc, contexts, unit)
    return result


def coincide(a: np.ndarray, b: np.ndarray, tol: float = 0.005) -> bool:
    """Two NLL curves indistinguishable on the plot: the same to ``tol`` of their mean."""
    return bool(np.abs(a - b).mean() <= tol * max(float(np.abs(a).mean()), 1e-9))


def plot_curves(curves: dict, path: str, dc: DemoConfig, contexts: Optional[dict] = None,
                unit: str = "token", smooth: int = 128) -> None:
    """Running-mean NLL against position, one panel per model ("model: method" keys; keys
    without a model go in one panel), one line per method (StreamingLLM Fig. 3). The cache size
    and each model's training context are marked; curves that coincide say so in the legend."""
    from .plots import figure, running_mean
    panels: dict = {}
    for name, nll in curves.items():
        model, sep, method = name.partition(": ")
        panels.setdefault(model if sep else "", {})[method if sep else name] = nll
    with figure(path, "the embedded corpus through each cache policy (StreamingLLM Fig. 3)",
                size=(6.5 * len(panels), 4.4), ncols=len(panels), squeeze=False,
                sharey=True) as axes:
        for ax, (model, lines) in zip(axes[0], panels.items()):
            drawn: list = []
            for method, nll in lines.items():
                same = [m for m in drawn if coincide(lines[m], nll)]
                k = min(smooth, len(nll))
                ax.plot(np.arange(k, len(nll) + 1), running_mean(nll, k), lw=1.3,
                        label=method + (f" (= {same[0]}, hidden under it)" if same else ""),
                        ls="--" if "recompute" in method else "-")
                drawn.append(method)
            ax.axvline(dc.cache, color="gray", lw=0.8, ls=":", label=f"cache size {dc.cache}")
            ctx = (contexts or {}).get(model)
            if ctx and ctx < max(len(v) for v in lines.values()):
                ax.axvline(ctx, color="black", lw=0.8, ls="-.", label=f"training context {ctx}")
            ax.set_xlabel("position in stream (tokens)")
            ax.set_title(model or "cache policies", fontsize=10)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel(f"NLL (nats per {unit}), mean of the last {smooth}")


def format_table(result: dict) -> str:
    lines = [f"{'model':<15} {'method':<32} {'ppl':>9} {'tok/s':>8} {'KV MiB':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['model']:<15} {r['method']:<32} {r['ppl']:>9.3f} "
                     f"{r['tokens_per_s']:>8.0f} {r['kv_mib']:>7.2f}")
    return "\n".join(lines)


def explain(result: dict) -> str:
    """What the table's numbers are and what they show, from the numbers themselves."""
    conf = dict(result["config"])
    conf["kv_quant"] = KVQuant(**conf.get("kv_quant", {}))
    dc, unit = DemoConfig(**conf), result.get("unit", "token")
    S = dc.sinks
    dense_p, window_p, stream_p, rec_p = (p.label for p in dc.policies())
    out = [f"ppl: perplexity per {unit} over {result['tokens_scored']} {unit}s of the embedded "
           f"corpus (lower is better); tok/s: scoring speed on this machine; KV MiB: the float32 "
           f"keys and values each method holds."]
    for model, ctx in result["training_context"].items():
        rows = {r["method"]: r["ppl"] for r in result["rows"] if r["model"] == model}
        dense, window = rows.get(dense_p), rows.get(window_p)
        stream, rec = rows.get(stream_p), rows.get(rec_p)
        line = f"{model} ({ctx}-{unit} training context): "
        parts = []
        if dense is not None and stream is not None and dense > 1.1 * stream:
            parts.append(f"the dense cache reads past its {ctx}-{unit} training context and "
                         f"degrades ({dense:.2f} vs {stream:.2f})")
        if window is not None and stream is not None:
            if window > 1.1 * stream:
                parts.append(f"window attention collapses once the first tokens leave the cache "
                             f"({window:.2f}) while StreamingLLM keeps {S} sinks ({stream:.2f})")
            else:
                parts.append(f"window {window:.2f} ~ StreamingLLM {stream:.2f}: no attention "
                             f"sink formed in this model, so evicting the first tokens costs "
                             f"nothing")
        if rec is not None and stream is not None:
            parts.append(f"StreamingLLM is within {abs(stream / rec - 1):.1%} of the recompute "
                         f"oracle")
        out.append(line + "; ".join(parts) + ".")
    return "\n".join(out)
