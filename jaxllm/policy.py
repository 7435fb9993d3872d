"""Cache policies: which past tokens each prediction sees (StreamingLLM §3, REFERENCE §1).

The one home of the rules every entry point (ppl, evals, generate, the CLI, the demo, the
benchmarks, training) shares:

* :class:`CachePolicy`: a method, its sink tokens and cache size, its window (``cache - sinks``),
  its label (``StreamingLLM 4+1020``) and the KV cache it needs;
* :func:`with_sink`: a learnable-sink model's stream starts with its sink token;
* :func:`can_stream` / :func:`check_positions`: learned absolute positions (OPT) cannot stream,
  nor read past their table.

Methods:

* ``dense``: one cache holding the whole text (no eviction).
* ``window``: the last ``cache`` tokens only (0 + W).
* ``streaming``: ``sinks`` initial tokens + the last ``cache - sinks`` (StreamingLLM).
* ``recompute``: sliding window with re-computation, the quality oracle: for every token the
  model is re-run from scratch on ``sinks`` initial tokens + the last ``cache - sinks`` tokens,
  O(T * cache^2).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .cache import KVCache, init_cache
from .config import ModelConfig
from .kvquant import KVQuant

METHODS = ("dense", "window", "recompute", "streaming")
_NAMES = {"dense": "dense", "window": "window", "recompute": "recompute",
          "streaming": "StreamingLLM"}


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """What each prediction sees: ``method`` (see the module docstring), ``sinks`` initial
    tokens kept, ``cache`` slots in all (sinks + window), fed ``chunk`` tokens per forward call
    (the chunk never changes the result)."""

    method: str = "streaming"
    sinks: int = 4
    cache: int = 1024  # total slots: sinks + window
    chunk: int = 256
    kv_quant: KVQuant = KVQuant()  # how the cache stores keys and values (jaxllm.kvquant)

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
        if self.kv_quant.enabled and self.method == "recompute":
            raise ValueError("recompute re-runs the model on every window and keeps no cache, so "
                             "there is no KV cache to quantize; use dense, window or streaming")

    @classmethod
    def of(cls, method: str = "streaming", sinks: Optional[int] = None, cache: int = 1024,
           chunk: int = 256, kv_quant: KVQuant = KVQuant()) -> "CachePolicy":
        """``sinks=None``: StreamingLLM's 4 for ``streaming``, none for the others."""
        if sinks is None:
            sinks = 4 if method == "streaming" else 0
        return cls(method, sinks, cache, chunk, kv_quant)

    @property
    def window(self) -> int:
        """Recent tokens kept besides the sinks."""
        return self.cache - self.sinks

    @property
    def label(self) -> str:
        """``StreamingLLM 4+1020``, ``window 0+1024``, ``recompute 4+1020`` or ``dense``."""
        name = _NAMES[self.method]
        label = name if self.method == "dense" else f"{name} {self.sinks}+{self.window}"
        return label + (f", KV {self.kv_quant.describe()}" if self.kv_quant.enabled else "")

    def make_cache(self, cfg: ModelConfig, batch: int, n_tokens: int, dtype=jnp.float32
                   ) -> KVCache:
        """The KV cache that streams ``n_tokens`` tokens under this policy (a dense cache holds
        them all; recompute keeps none between predictions, so it has no cache)."""
        if self.method == "recompute":
            raise ValueError("recompute re-runs the model on every window: it keeps no cache")
        if self.method == "dense":
            if self.kv_quant.format == "kivi":  # KIVI's key blocks must tile the cache
                R = self.kv_quant.residual
                n_tokens = -(-n_tokens // R) * R
            return init_cache(cfg, batch, sinks=0, window=n_tokens, evict=False, dtype=dtype,
                              kv_quant=self.kv_quant)
        return init_cache(cfg, batch, sinks=self.sinks, window=self.window, dtype=dtype,
                          kv_quant=self.kv_quant)


def with_sink(cfg: ModelConfig, tokens, keep_length: bool = False):
    """The stream a model expects: a learnable-sink model (trained with its sink token first in
    every sample) gets ``cfg.sink_id`` in front of every row of ``tokens`` ([T] or [B, T], numpy
    or jax); other models get ``tokens`` unchanged. ``keep_length``: drop each row's last token
    so the shape stays."""
    if cfg.sink_id is None:
        return tokens
    xp = np if isinstance(tokens, np.ndarray) else jnp
    sink = xp.full(tokens.shape[:-1] + (1,), cfg.sink_id, tokens.dtype)
    out = xp.concatenate([sink, tokens], -1)
    return out[..., :-1] if keep_length else out


def can_stream(cfg: ModelConfig) -> bool:
    """Learned absolute positions (OPT) exist for stream positions 0..max_seq_len-1 only: a
    window or StreamingLLM cache renumbers tokens by their place in the cache, positions such a
    model never learned. RoPE and ALiBi models stream."""
    return cfg.pos_emb != "learned"


def check_positions(cfg: ModelConfig, method: str, n_positions: int) -> None:
    """Refuse what a learned-position model cannot do: stream (``window``/``streaming``), or
    read ``n_positions`` > its table (a dense cache over more tokens, a longer recompute window
    or training sequence): the position table would clamp them silently."""
    if can_stream(cfg):
        return
    L = cfg.max_seq_len
    if method in ("window", "streaming"):
        raise ValueError(f"{cfg.family} has learned absolute positions, so it cannot stream: a "
                         f"window or StreamingLLM cache renumbers tokens by their place in the "
                         f"cache, positions this model never learned to read. Use method dense "
                         f"(at most {L} tokens) or recompute (cache <= {L}), or a RoPE/ALiBi "
                         f"model for streaming")
    if n_positions > L:
        what = {"dense": f"a dense cache over {n_positions} tokens",
                "recompute": f"a recompute window of {n_positions}"}.get(
                    method, f"a sequence of {n_positions} tokens")
        raise ValueError(f"{cfg.family} has learned positions for {L} tokens; {what} exceeds "
                         f"them and would read positions it never learned: use at most {L}")
