"""Streaming perplexity: per-token NLL of a text through a cache policy (StreamingLLM Fig. 3).

The policies (dense, window, StreamingLLM, recompute, H2O, Q-Hitter) are the variants of
:class:`jaxllm.policy.CachePolicy`. ``chunk`` tokens go into each forward call; the chunk never
changes the result, only the speed.
"""
from __future__ import annotations

import functools
import math
import resource
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .generate import greedy
from .model import apply
from .plots import figure, running_mean
from .policy import CachePolicy, Recompute, StreamingLLM
from .positions import with_sink
from .weight_only import loop_weights

__all__ = ["recompute_at", "run_ppl", "stream_nll",
           "stream_score", "summarize"]


def _score(logits, targets):
    """NLL of each target and whether it is the argmax (greedy decoding would produce it)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return nll, greedy(logits) == targets


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def nll_chunk(params, cfg: ModelConfig, cache, toks, targets, lens):
    """(NLL, hit) of ``targets`` [B, T] after each token of ``toks``, as the cache's kind scores
    a chunk (jaxllm.kinds: whole, or one token at a time for a kind that decides what to keep
    after every token), and the cache after it."""
    def forward(c, t, n, in_loop):
        p = params
        if in_loop:  # tied to a value that changes every step, else XLA widens W8/bf16
            p, n = loop_weights(params, n)  # weights once, before the loop
        return apply(p, cfg, t, c, n)

    logits, cache = cache.kind.score(forward, cache, toks, lens)
    return _score(logits, targets), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def _nll_last(params, cfg: ModelConfig, windows, targets):
    """Plain forward on each window [R, L]; NLL of ``targets`` [R] from the last position."""
    logits, _ = apply(params, cfg, windows, None, None, last_only=True)  # [R, 1, V]
    return _score(logits[:, 0], targets)


def _cached_nll(params, cfg, tokens, pc: CachePolicy, chunk: int, bar):
    n = len(tokens) - 1
    cache = pc.make_cache(cfg, 1, n)
    C = min(chunk, n)
    nll, hit = np.empty(n, np.float32), np.empty(n, bool)
    for s in range(0, n, C):
        m = min(C, n - s)
        # The last chunk is padded to C (padding is never written) so nothing recompiles.
        toks = np.zeros((1, C), np.int32)
        tgts = np.zeros((1, C), np.int32)
        toks[0, :m], tgts[0, :m] = tokens[s:s + m], tokens[s + 1:s + 1 + m]
        (out, ok), cache = nll_chunk(params, cfg, cache, toks, tgts, np.array([m], np.int32))
        nll[s:s + m], hit[s:s + m] = np.asarray(out)[0, :m], np.asarray(ok)[0, :m]
        bar.update(m)
    return nll, hit


def _recompute_nll(params, cfg, tokens, pc: Recompute, chunk: int, bar):
    n, L = len(tokens) - 1, pc.cache
    first = min(L, n)  # while t < L nothing is evicted: one causal forward is exact
    nll, hit = np.empty(n, np.float32), np.empty(n, bool)
    logits, _ = apply(params, cfg, jnp.asarray(tokens[None, :first], jnp.int32), None, None)
    out, ok = _score(logits[0], jnp.asarray(tokens[1:first + 1]))
    nll[:first], hit[:first] = np.asarray(out), np.asarray(ok)
    bar.update(first)
    if first < n:
        nll[first:], hit[first:] = _windows_nll(params, cfg, tokens, pc,
                                                np.arange(first, n), bar)
    return nll, hit


def _windows_nll(params, cfg, tokens, pc: Recompute, ts: np.ndarray, bar=None):
    """(NLL, hit) of tokens[t + 1] for each t in ``ts`` (t >= pc.cache), each from a fresh
    forward over the sinks and the last ``pc.window`` tokens up to t: sliding window with
    re-computation (StreamingLLM's baseline), a few windows per call."""
    S, W = pc.sinks, pc.window
    R = max(1, min(64, 16384 // pc.cache))  # windows per forward call
    nll, hit = np.empty(len(ts), np.float32), np.empty(len(ts), bool)
    for i in range(0, len(ts), R):
        part = ts[i:i + R]
        wins = np.stack([np.concatenate([tokens[:S], tokens[t - W + 1:t + 1]]) for t in part])
        tg = tokens[part + 1]
        pad = R - len(part)
        if pad:
            wins, tg = np.concatenate([wins, np.repeat(wins[-1:], pad, 0)]), np.pad(tg, (0, pad))
        out, ok = _nll_last(params, cfg, jnp.asarray(wins, jnp.int32), jnp.asarray(tg, jnp.int32))
        nll[i:i + len(part)], hit[i:i + len(part)] = np.asarray(out)[:len(part)], \
            np.asarray(ok)[:len(part)]
        if bar is not None:
            bar.update(len(part))
    return nll, hit


def recompute_at(params, cfg: ModelConfig, tokens, pc: Recompute, positions,
                 progress: bool = False, desc: Optional[str] = None) -> np.ndarray:
    """NLL of tokens[t + 1] at each of ``positions`` (each >= ``pc.cache``: where the window
    has slid) by sliding window with re-computation (``pc``: its sinks and cache): the baseline scored at sampled positions, for a paired comparison with another
    policy's :func:`stream_score` at the same indices, without recomputing every token."""
    from .progress import bar as progress_bar
    if not isinstance(pc, Recompute):
        raise ValueError(f"recompute_at takes a Recompute policy, got {pc.label}")
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    positions = np.asarray(positions, np.int64)
    if positions.size and (positions.min() < pc.cache or positions.max() >= tokens.size - 1):
        raise ValueError(f"positions must lie in [{pc.cache}, {tokens.size - 1}) (the cache "
                         f"size, and a token to predict after each); got {positions.min()}.."
                         f"{positions.max()}")
    lead = with_sink(cfg, tokens)
    skip = lead.size - tokens.size  # a learnable sink in front: indices shift by one
    pc.check(cfg, lead.size)
    with progress_bar(total=positions.size, unit="tok", disable=not progress,
                      desc=desc or "recompute") as bar:
        return _windows_nll(params, cfg, lead, pc, positions + skip, bar)[0]


def stream_nll(params, cfg: ModelConfig, tokens, pc: CachePolicy = StreamingLLM(),
               progress: bool = False, chunk: int = 256) -> np.ndarray:
    """NLL (nats) of tokens[1:], each predicted from what ``pc`` keeps of its past."""
    return stream_score(params, cfg, tokens, pc, progress, chunk=chunk)[0]


def stream_score(params, cfg: ModelConfig, tokens, pc: CachePolicy = StreamingLLM(),
                 progress: bool = False, desc: Optional[str] = None, chunk: int = 256
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(NLL, argmax hit) of tokens[1:], each predicted from what ``pc`` keeps of its past.
    A span of hits is an exact match: greedy decoding from its prefix would produce it.
    A learnable-sink model gets its sink token in front of the stream (it was trained with one
    first in every sample); the scores are still those of tokens[1:]."""
    from .progress import bar as progress_bar
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if tokens.size < 2:
        raise ValueError(f"need at least 2 tokens to score, got {tokens.size}; is the text empty?")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}); got {tokens.min()}.."
                         f"{tokens.max()}: does the tokenizer match the model?")
    lead = with_sink(cfg, tokens)
    pc = pc.resolve(lead.size)  # h2o/qhitter budgets given as fractions of the text
    pc.check(cfg, lead.size)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    skip = lead.size - tokens.size  # predictions of tokens[0] from the sink: not scored
    with progress_bar(total=lead.size - 1, unit="tok", unit_scale=True, disable=not progress,
                      desc=desc or f"ppl {pc.name}") as bar:
        fn = _cached_nll if pc.keeps_cache else _recompute_nll
        nll, hit = fn(params, cfg, lead, pc, chunk, bar)
    return nll[skip:], hit[skip:]


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize(nll: np.ndarray, bucket: int = 1000) -> dict:
    """Overall perplexity and perplexity per ``bucket``-token slice of the stream."""
    buckets = [{"start": s, "end": min(s + bucket, len(nll)),
                "ppl": float(math.exp(nll[s:s + bucket].astype(np.float64).mean()))}
               for s in range(0, len(nll), bucket)]
    return {"tokens_scored": int(len(nll)), "nll": float(nll.astype(np.float64).mean()),
            "ppl": float(math.exp(nll.astype(np.float64).mean())), "ppl_per_bucket": buckets,
            "bucket": bucket, "nan_count": int(np.isnan(nll).sum())}


def plot_nll(nll: np.ndarray, path: str, title: str, smooth: Optional[int] = None) -> None:
    """Per-token NLL against position (faint) with its running mean."""
    smooth = smooth or max(1, min(256, len(nll) // 20))
    with figure(path, title) as ax:
        x = np.arange(1, len(nll) + 1)
        ax.plot(x, nll, lw=0.3, alpha=0.25, color="tab:blue", label="per token")
        if len(nll) >= smooth:
            ax.plot(x[smooth - 1:], running_mean(nll, smooth), lw=1.5, color="tab:red",
                    label=f"mean of {smooth}")
        ax.set_xlabel("position in stream (tokens)")
        ax.set_ylabel("NLL (nats)")
        ax.legend(loc="upper right")


def run_ppl(params, cfg: ModelConfig, tokens, pc: CachePolicy, progress: bool = True,
            chunk: int = 256) -> tuple:
    """``(nll, summary)`` where the summary carries timing (tokens/s and seconds leave
    compilation out; ``compile_seconds`` is apart) and peak memory."""
    from .progress import watch_compiles
    pc = pc.resolve(len(with_sink(cfg, np.asarray(tokens).reshape(-1))))
    with watch_compiles() as compiling:
        t0 = time.perf_counter()
        nll = stream_nll(params, cfg, tokens, pc, progress, chunk)
        secs = max(time.perf_counter() - t0 - compiling[0], 1e-9)
    summary = {"method": pc.name, "label": pc.label, "sinks": pc.sinks,
               "cache": pc.slots(len(nll)), "chunk": chunk,
               "kv_dtype": pc.storage.dtype if pc.storage else None, **summarize(nll),
               "seconds": secs, "compile_seconds": compiling[0],
               "tokens_per_s": len(nll) / secs, "peak_rss_mb": peak_rss_mb(),
               "jax": jax.__version__, "backend": jax.default_backend()}
    return nll, summary
