"""Streaming perplexity: per-token NLL of a text through a cache policy (StreamingLLM Fig. 3).

Methods (REFERENCE §1):
* ``dense``: one cache holding the whole text (no eviction).
* ``window``: the last ``cache`` tokens only (0 + W).
* ``streaming``: ``sinks`` initial tokens + the last ``cache - sinks`` (StreamingLLM).
* ``recompute``: sliding window with re-computation, the quality oracle: for every token the
  model is re-run from scratch on ``sinks`` initial tokens + the last ``cache - sinks`` tokens,
  O(T * cache^2).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import resource
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .cache import init_cache
from .config import ModelConfig
from .model import _forward

METHODS = ("dense", "window", "recompute", "streaming")


@dataclasses.dataclass(frozen=True)
class PplConfig:
    method: str = "streaming"
    sinks: int = 4
    cache: int = 1024  # total slots: sinks + window
    chunk: int = 256  # tokens per forward call (does not change the result)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.method in ("dense", "window") and self.sinks:
            raise ValueError(f"--method {self.method} keeps no sink tokens (got sinks="
                             f"{self.sinks}); use --method streaming or recompute for sinks")
        if self.cache < 1:
            raise ValueError(f"cache must be >= 1, got {self.cache}")
        if self.method != "dense" and self.cache - self.sinks < 1:
            raise ValueError(f"cache {self.cache} must exceed sinks {self.sinks}: the window "
                             f"(cache - sinks) must hold at least one token")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")


def _score(logits, targets):
    """NLL of each target and whether it is the argmax (greedy decoding would produce it)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1) == targets


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _nll_chunk(params, cfg: ModelConfig, cache, toks, targets, lens):
    logits, cache = _forward(params, cfg, toks, cache, lens)
    return _score(logits, targets), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def _nll_last(params, cfg: ModelConfig, windows, targets):
    """Plain forward on each window [R, L]; NLL of ``targets`` [R] from the last position."""
    logits, _ = _forward(params, cfg, windows, None, None)
    return _score(logits[:, -1], targets)


def _cached_nll(params, cfg, tokens, pc: PplConfig, bar):
    n = len(tokens) - 1
    if pc.method == "dense":
        cache = init_cache(cfg, 1, sinks=0, window=n, evict=False)
    else:
        sinks = pc.sinks if pc.method == "streaming" else 0
        cache = init_cache(cfg, 1, sinks=sinks, window=pc.cache - sinks)
    C = min(pc.chunk, n)
    nll, hit = np.empty(n, np.float32), np.empty(n, bool)
    for s in range(0, n, C):
        m = min(C, n - s)
        # The last chunk is padded to C (padding is never written) so nothing recompiles.
        toks = np.zeros((1, C), np.int32)
        tgts = np.zeros((1, C), np.int32)
        toks[0, :m], tgts[0, :m] = tokens[s:s + m], tokens[s + 1:s + 1 + m]
        (out, ok), cache = _nll_chunk(params, cfg, cache, toks, tgts, np.array([m], np.int32))
        nll[s:s + m], hit[s:s + m] = np.asarray(out)[0, :m], np.asarray(ok)[0, :m]
        bar.update(m)
    return nll, hit


def _recompute_nll(params, cfg, tokens, pc: PplConfig, bar):
    n, S, L = len(tokens) - 1, pc.sinks, pc.cache
    W = L - S
    first = min(L, n)  # while t < L nothing is evicted: one causal forward is exact
    nll, hit = np.empty(n, np.float32), np.empty(n, bool)
    logits, _ = _forward(params, cfg, jnp.asarray(tokens[None, :first], jnp.int32), None, None)
    out, ok = _score(logits[0], jnp.asarray(tokens[1:first + 1]))
    nll[:first], hit[:first] = np.asarray(out), np.asarray(ok)
    bar.update(first)
    R = max(1, min(64, 16384 // L))  # windows per forward call
    sink_part = tokens[:S]
    for s in range(first, n, R):
        ts = np.arange(s, min(s + R, n))
        wins = np.stack([np.concatenate([sink_part, tokens[t - W + 1:t + 1]]) for t in ts])
        tg = tokens[ts + 1]
        pad = R - len(ts)
        if pad:
            wins, tg = np.concatenate([wins, np.repeat(wins[-1:], pad, 0)]), np.pad(tg, (0, pad))
        out, ok = _nll_last(params, cfg, jnp.asarray(wins, jnp.int32), jnp.asarray(tg, jnp.int32))
        nll[ts], hit[ts] = np.asarray(out)[:len(ts)], np.asarray(ok)[:len(ts)]
        bar.update(len(ts))
    return nll, hit


def stream_nll(params, cfg: ModelConfig, tokens, pc: PplConfig = PplConfig(),
               progress: bool = False) -> np.ndarray:
    """NLL (nats) of tokens[1:], each predicted from what ``pc.method`` keeps of its past."""
    return stream_score(params, cfg, tokens, pc, progress)[0]


def stream_score(params, cfg: ModelConfig, tokens, pc: PplConfig = PplConfig(),
                 progress: bool = False, desc: Optional[str] = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(NLL, argmax hit) of tokens[1:], each predicted from what ``pc.method`` keeps of its past.
    A span of hits is an exact match: greedy decoding from its prefix would produce it.
    A learnable-sink model gets its sink token in front of the stream (it was trained with one
    first in every sample); the scores are still those of tokens[1:]."""
    from tqdm.auto import tqdm
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if tokens.size < 2:
        raise ValueError(f"need at least 2 tokens to score, got {tokens.size}; is the text empty?")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}); got {tokens.min()}.."
                         f"{tokens.max()}: does the tokenizer match the model?")
    lead = with_sink(cfg, tokens)
    check_positions(cfg, pc, lead.size)
    skip = lead.size - tokens.size  # predictions of tokens[0] from the sink: not scored
    with tqdm(total=lead.size - 1, unit="tok", unit_scale=True, disable=not progress,
              desc=desc or f"ppl {pc.method}") as bar:
        fn = _recompute_nll if pc.method == "recompute" else _cached_nll
        nll, hit = fn(params, cfg, lead, pc, bar)
    return nll[skip:], hit[skip:]


def check_positions(cfg: ModelConfig, pc: PplConfig, n_tokens: int) -> None:
    """Learned absolute positions (OPT) exist for 0..max_seq_len-1 only: such a model cannot
    stream, a dense cache holding more tokens or a recompute window longer than that would
    read positions it never learned (the position table clamps them silently)."""
    if cfg.pos_emb != "learned":
        return
    L = cfg.max_seq_len
    if pc.method in ("window", "streaming"):
        raise ValueError(f"{cfg.family} has learned absolute positions, so it cannot stream: use "
                         f"method dense (at most {L} tokens) or recompute (cache <= {L})")
    if pc.method == "dense" and n_tokens > L:
        raise ValueError(f"{cfg.family} has learned positions for {L} tokens; a dense cache over "
                         f"{n_tokens} tokens reads positions it never learned: score at most {L} "
                         f"tokens, or use method recompute with cache <= {L}")
    if pc.method == "recompute" and pc.cache > L:
        raise ValueError(f"{cfg.family} has learned positions for {L} tokens; a recompute window "
                         f"of {pc.cache} exceeds them: use cache <= {L}")


def with_sink(cfg: ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """The stream a model expects: a learnable-sink model's sink token first, then ``tokens``."""
    if cfg.sink_id is None:
        return tokens
    return np.concatenate([np.array([cfg.sink_id], tokens.dtype), tokens])


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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    smooth = smooth or max(1, min(256, len(nll) // 20))
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(1, len(nll) + 1)
    ax.plot(x, nll, lw=0.3, alpha=0.25, color="tab:blue", label="per token")
    if len(nll) >= smooth:
        mean = np.convolve(nll, np.ones(smooth) / smooth, mode="valid")
        ax.plot(x[smooth - 1:], mean, lw=1.5, color="tab:red", label=f"mean of {smooth}")
    ax.set_xlabel("position in stream (tokens)")
    ax.set_ylabel("NLL (nats)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_ppl(params, cfg: ModelConfig, tokens, pc: PplConfig, progress: bool = True) -> tuple:
    """``(nll, summary)`` where the summary carries timing and peak memory."""
    t0 = time.perf_counter()
    nll = stream_nll(params, cfg, tokens, pc, progress)
    secs = time.perf_counter() - t0
    summary = {"method": pc.method, "sinks": pc.sinks if pc.method in ("streaming", "recompute")
               else 0, "cache": pc.cache if pc.method != "dense" else len(nll), "chunk": pc.chunk,
               **summarize(nll), "seconds": secs, "tokens_per_s": len(nll) / secs,
               "peak_rss_mb": peak_rss_mb(), "jax": jax.__version__,
               "backend": jax.default_backend()}
    return nll, summary
