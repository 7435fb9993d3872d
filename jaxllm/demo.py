"""``jaxllm demo``: the main job in one command, on the packaged SmolLM2-135M by default.

Streams the embedded corpus (Python's documentation) through a dense cache, window attention
and StreamingLLM (StreamingLLM Fig. 3 and Table 1's rows), scores sliding window with
re-computation at seeded positions sampled past the first window (a paired comparison: the
StreamingLLM run's losses at the same positions stand beside it), plots the running NLL and says
in plain words what the numbers show. Then a streaming chat: fixed questions, greedy, in the
model's chat template, through one small StreamingLLM cache that the rounds together overflow
(a model without a chat template continues a prompt instead).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import jax
import numpy as np

from .kv.quantized import KVQuant
from .policy import CachePolicy, Dense, KVStorage, Recompute, StreamingLLM, Window
from .ppl import recompute_at, stream_score
from .progress import watch_compiles

# Questions of the chat, each with the words one of which a right answer contains.
QUESTIONS = (("What is the capital of France?", ("paris",)),
             ("How many legs does a spider have?", ("8", "eight")),
             ("What color is the sky on a clear day?", ("blue",)),
             ("What is the largest planet in our solar system?", ("jupiter",)),
             ("What do bees make?", ("honey",)),
             ("What is H2O commonly called?", ("water",)))


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    tokens: int = 4096  # stream length
    cache: int = 256  # W: sinks + window for window / StreamingLLM / recompute
    sinks: int = 4
    positions: int = 64  # recompute is scored at this many positions drawn from [W, tokens)
    seed: int = 0  # of the drawn positions
    int8: bool = False  # also StreamingLLM on a SmoothQuant O1 copy
    kv_quant: KVQuant = KVQuant()  # enabled: one more row, StreamingLLM with this KV storage
    chat_cache: int = 160  # sinks + window of the chat's cache: the rounds overflow it
    chat_tokens: int = 48  # most tokens an answer may take
    questions: tuple = QUESTIONS
    # A model without a chat template (the byte-level models trained here) continues this:
    prompt: str = "The with statement is used to"
    new_tokens: int = 160
    temperature: float = 0.7  # sampled (top-k 40, fixed seed): greedy decoding of a small
    top_k: int = 40           # byte model loops on one phrase

    def policies(self) -> list[CachePolicy]:
        """The streamed rows: dense, window and StreamingLLM."""
        S, C = self.sinks, self.cache
        return [Dense(), Window(C), StreamingLLM(S, C)]

    @property
    def recompute(self) -> Recompute:
        return Recompute(self.sinks, self.cache)

    @property
    def generation_policy(self) -> StreamingLLM:
        """The cache the chat (or the continuation) streams through."""
        return StreamingLLM(self.sinks, self.chat_cache)

    def sampled_positions(self, n_tokens: int) -> np.ndarray:
        """Sorted positions t (the prediction of token t + 1) drawn without replacement from
        [cache, n_tokens - 1), where the window has slid."""
        lo, hi = self.cache, n_tokens - 1
        k = min(self.positions, max(hi - lo, 0))
        return np.sort(np.random.default_rng(self.seed).choice(np.arange(lo, hi), k,
                                                               replace=False))


def _kv_mib(cfg, pc: CachePolicy, slots: int) -> float:
    """MiB of the keys and values ``pc`` holds for ``slots`` (from the arrays' shapes)."""
    shapes = jax.eval_shape(lambda: pc.make_cache(cfg, 1, slots))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((shapes.k, shapes.v))) / 2 ** 20


def _run(params, cfg, ids, pc: CachePolicy, desc: str) -> tuple[np.ndarray, dict]:
    """One stream, run once: its tokens/s leave out the compile time (progress.watch_compiles)."""
    with watch_compiles() as spent:
        t0 = time.perf_counter()
        nll = stream_score(params, cfg, ids, pc, True, desc)[0]
        secs = time.perf_counter() - t0
    slots = pc.slots(len(ids) + 1)
    return nll, {"ppl": float(np.exp(nll.astype(np.float64).mean())),
                 "tokens_per_s": len(nll) / max(secs - spent[0], 1e-9),
                 "kv_mib": _kv_mib(cfg, pc, slots), "positions": len(nll)}


def _recompute_row(params, cfg, ids, dc: DemoConfig, label: str, stream_nll: np.ndarray):
    """Recompute at the sampled positions, with StreamingLLM's NLL at the same positions."""
    pos = dc.sampled_positions(len(ids))
    with watch_compiles() as spent:
        t0 = time.perf_counter()
        nll = recompute_at(params, cfg, ids, dc.recompute, pos, True, f"{label}: recompute")
        secs = time.perf_counter() - t0
    paired = stream_nll[pos]
    row = {"ppl": float(np.exp(nll.astype(np.float64).mean())),
           "tokens_per_s": len(pos) / max(secs - spent[0], 1e-9),
           "kv_mib": _kv_mib(cfg, Dense(), dc.cache),
           "positions": int(len(pos)),
           "streaming_ppl_same_positions": float(np.exp(paired.astype(np.float64).mean()))}
    return row, {"positions": [int(p) for p in pos],
                 "recompute": [round(float(x), 4) for x in nll],
                 "streaming": [round(float(x), 4) for x in paired]}


def run_demo(models: dict, ids: np.ndarray, calib_ids: np.ndarray, dc: DemoConfig,
             out_dir: str) -> dict:
    """The scoring half: ``models``: label -> (cfg, params, tokenizer); ``ids`` the stream,
    ``calib_ids`` other text for SmoothQuant's calibration. Returns the results (``chat`` and
    ``generations`` empty until :func:`run_chats`) and writes ``demo.png``."""
    os.makedirs(out_dir, exist_ok=True)
    rows, curves, sampled, contexts = [], {}, {}, {}
    for label, (cfg, params, tok) in models.items():
        contexts[label] = cfg.max_seq_len
        stream_rows = list(dc.policies())
        if dc.kv_quant.enabled:
            stream_rows.append(dataclasses.replace(stream_rows[2],
                                                   storage=KVStorage(quant=dc.kv_quant)))
        for pc in stream_rows:
            nll, r = _run(params, cfg, ids, pc, f"{label}: {pc.label}")
            rows.append({"model": label, "method": pc.label, **r})
            curves[f"{label}: {pc.label}"] = nll
        streaming_nll = curves[f"{label}: {stream_rows[2].label}"]
        if dc.int8:
            from .smoothquant import CalibConfig, quantize
            q = quantize(params, cfg, calib_ids, "o1", calib=CalibConfig(
                n_seqs=32, seq_len=min(256, len(calib_ids) // 33), heldout_seqs=0))
            nll, r = _run(q, cfg, ids, stream_rows[2], f"{label}: INT8 streaming")
            rows.append({"model": label, "method": f"{stream_rows[2].label}, INT8 O1", **r})
            curves[f"{label}: INT8 StreamingLLM"] = nll
        r, sampled[label] = _recompute_row(params, cfg, ids, dc, label, streaming_nll)
        rows.append({"model": label, "method": f"{dc.recompute.label}, sampled", **r})
    unit = "byte" if all(type(t).__name__ == "ByteTokenizer" for _, _, t in models.values()) \
        else "token"
    config = dict(dataclasses.asdict(dc), kv_quant=dataclasses.asdict(dc.kv_quant))
    result = {"config": config, "tokens_scored": int(len(ids) - 1),
              "unit": unit, "training_context": contexts, "rows": rows, "chat": {},
              "generations": {}, "sampled": sampled,
              # the per-position NLL (nats) that demo.png plots, one list per model and method
              "curves": {k: [round(float(x), 4) for x in v] for k, v in curves.items()}}
    plot_curves(curves, os.path.join(out_dir, "demo.png"), dc, contexts, unit, sampled=sampled)
    return result


def run_chats(models: dict, dc: DemoConfig, result: dict, echo=print) -> dict:
    """The generation half, into ``result``: each model with a chat template chats (its rounds
    echoed as they finish), the others continue ``dc.prompt``."""
    for label, (cfg, params, tok) in models.items():
        if getattr(tok, "has_chat_template", False):
            result["chat"][label] = _chat(params, cfg, tok, dc, label, echo)
        else:
            result["generations"][label] = _continue(params, cfg, tok, dc)
    return result


def _chat(params, cfg, tok, dc: DemoConfig, label: str, echo) -> list[dict]:
    from .chat import chat
    from .generate import SamplingConfig
    pc = dc.generation_policy
    echo(f"\n[{label}] a chat through one {pc.label} cache ({dc.chat_cache} slots), greedy:")

    def show(r):
        echo(f"  Q: {r.question}\n  A: {r.answer}\n     ({r.seen} tokens so far, the cache "
             f"holds {r.held}: {r.kv_bytes / 2 ** 20:.2f} MiB of keys and values)")
    rounds, _ = chat(params, cfg, tok, [q for q, _ in dc.questions],
                     pc.make_cache(cfg, 1, dc.chat_cache),
                     SamplingConfig(max_new_tokens=dc.chat_tokens), on_round=show)
    return [dict(r._asdict(), expected=list(words),
                 correct=any(w in r.answer.lower() for w in words))
            for r, (_, words) in zip(rounds, dc.questions)]


def _continue(params, cfg, tok, dc: DemoConfig) -> str:
    """A sampled continuation of ``dc.prompt`` through the StreamingLLM cache."""
    from .generate import SamplingConfig, generate
    cache = dc.generation_policy.make_cache(cfg, 1, 0)
    prompt = np.asarray([tok.encode(dc.prompt)], np.int32)
    res = generate(params, cfg, prompt, cache, SamplingConfig(
        max_new_tokens=dc.new_tokens, temperature=dc.temperature, top_k=dc.top_k),
        jax.random.key(0))
    return tok.decode(list(np.asarray(res.tokens[0, :int(res.num_tokens[0])])))


def write_result(result: dict, out_dir: str) -> None:
    from .outputs import write_json
    write_json(os.path.join(out_dir, "demo.json"), result)


def coincide(a: np.ndarray, b: np.ndarray, tol: float = 0.005) -> bool:
    """Two NLL curves indistinguishable on the plot: the same to ``tol`` of their mean."""
    return bool(np.abs(a - b).mean() <= tol * max(float(np.abs(a).mean()), 1e-9))


def plot_curves(curves: dict, path: str, dc: DemoConfig, contexts: Optional[dict] = None,
                unit: str = "token", smooth: int = 128, sampled: Optional[dict] = None) -> None:
    """Running-mean NLL against position, one panel per model ("model: method" keys; keys
    without a model go in one panel), one line per method (StreamingLLM Fig. 3). The cache size
    and each model's training context are marked; curves that coincide say so in the legend.
    ``sampled``: model -> {"positions", "recompute", "streaming"}: recompute's NLL at those
    positions, drawn as a running mean over groups of them."""
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
                        label=method + (f" (= {same[0]}, hidden under it)" if same else ""))
                drawn.append(method)
            s = (sampled or {}).get(model)
            if s and len(s["positions"]) >= 2:
                # The paired comparison: both at the sampled positions, averaged alike (the
                # lines above average 128 consecutive tokens, so they are not comparable).
                g = max(1, min(16, len(s["positions"]) // 4))
                x = running_mean(s["positions"], g)
                n = len(s["positions"])
                ax.plot(x, running_mean(s["recompute"], g), "k--", marker="o", ms=3, lw=1,
                        label=f"{dc.recompute.label} at {n} sampled positions (mean of {g})")
                ax.plot(x, running_mean(s["streaming"], g), ":", color="tab:green", marker="s",
                        ms=3, lw=1, label=f"StreamingLLM at the same positions (mean of {g})")
            ax.axvline(dc.cache, color="gray", lw=0.8, ls=":", label=f"cache size {dc.cache}")
            ctx = (contexts or {}).get(model)
            if ctx and ctx < max(len(v) for v in lines.values()):
                ax.axvline(ctx, color="black", lw=0.8, ls="-.", label=f"training context {ctx}")
            ax.set_xlabel(f"position in stream ({unit}s)")
            ax.set_title(model or "cache policies", fontsize=10)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel(f"NLL (nats per {unit}), mean of the last {smooth}")


def format_table(result: dict) -> str:
    lines = [f"{'model':<15} {'method':<34} {'ppl':>9} {'tok/s':>8} {'KV MiB':>7} "
             f"{'scored':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['model']:<15} {r['method']:<34} {r['ppl']:>9.3f} "
                     f"{r['tokens_per_s']:>8.0f} {r['kv_mib']:>7.2f} {r['positions']:>7}")
    return "\n".join(lines)


def explain(result: dict) -> str:
    """What the table's numbers are and what they show, from the numbers themselves."""
    conf = dict(result["config"])
    conf["kv_quant"] = KVQuant(**conf.get("kv_quant", {}))
    conf["questions"] = tuple((q, tuple(w)) for q, w in conf.get("questions", ()))
    dc, unit = DemoConfig(**conf), result.get("unit", "token")
    S = dc.sinks
    dense_p, window_p, stream_p = (p.label for p in dc.policies())
    rec_p = f"{dc.recompute.label}, sampled"
    out = [f"ppl: perplexity per {unit} over {result['tokens_scored']} {unit}s of the embedded "
           f"corpus (lower is better; recompute: over the sampled positions only); tok/s: "
           f"scoring speed on this machine, compilation left out; KV MiB: the float32 keys and "
           f"values each method holds."]
    for model, ctx in result["training_context"].items():
        rows = {r["method"]: r for r in result["rows"] if r["model"] == model}
        ppl = lambda m: rows[m]["ppl"] if m in rows else None  # noqa: E731
        dense, window, stream, rec = ppl(dense_p), ppl(window_p), ppl(stream_p), ppl(rec_p)
        parts = []
        if dense is not None and stream is not None and dense > 1.1 * stream:
            parts.append(f"the dense cache reads past its {ctx}-{unit} training context and "
                         f"degrades ({dense:.2f} vs {stream:.2f})")
        if window is not None and stream is not None:
            if window > 1.1 * stream:
                parts.append(f"window attention collapses once the first {unit}s leave the "
                             f"cache ({window:.2f}, {window / stream:.2f}x) while StreamingLLM, "
                             f"keeping {S} attention sinks, holds ({stream:.2f})")
            else:
                parts.append(f"window {window:.2f} ~ StreamingLLM {stream:.2f}: no attention "
                             f"sink formed in this model, so evicting the first {unit}s costs "
                             f"nothing")
        if rec is not None:
            r = rows[rec_p]
            paired = r["streaming_ppl_same_positions"]
            parts.append(f"at the {r['positions']} sampled positions StreamingLLM scores "
                         f"{paired:.2f} against recompute's {rec:.2f} ({paired / rec - 1:+.1%}), "
                         f"recomputing nothing")
        out.append(f"{model} ({ctx}-{unit} training context): " + "; ".join(parts) + ".")
    return "\n".join(out)


def explain_chats(result: dict) -> str:
    """How each model's chat went: answers with their expected word, and when the cache was
    full (so later answers came through StreamingLLM's eviction)."""
    out = []
    for model, chat in result.get("chat", {}).items():
        right = sum(r["correct"] for r in chat)
        full = next((i for i, r in enumerate(chat) if r["seen"] > r["held"]), None)
        over = (f"; the cache was full from round {full + 1} on, and the later answers came "
                f"through StreamingLLM's eviction" if full is not None else "")
        out.append(f"{model} chat: {right} of {len(chat)} answers contain their expected "
                   f"word{over}.")
    return "\n".join(out)
