"""Sliding window with re-computation (StreamingLLM's quality oracle, Fig. 3): for every token
the model is re-run from scratch on ``sinks`` initial tokens + the last ``cache - sinks``,
O(T * cache^2). It keeps no cache between predictions, so it has no KV storage to choose
(jaxllm.ppl scores it)."""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..kv.cache import KVCache
from ..positions import check_positions
from .base import CachePolicy


@dataclasses.dataclass(frozen=True)
class Recompute(CachePolicy):
    """Each prediction from a fresh forward over the sinks and the last ``window`` tokens;
    positions 0..cache-1 in every window, so learned-position models run it too."""

    sinks: int = 0
    cache: int = 1024
    name = "recompute"
    title = "recompute"
    streams = False
    keeps_cache = False

    def __post_init__(self):
        self._check_slots()

    def check(self, cfg: ModelConfig, n_tokens: int) -> None:
        check_positions(cfg, self.cache, what=f"a recompute window of {self.cache}")

    def make_cache(self, cfg: ModelConfig, batch: int, n_tokens: int, dtype=None) -> KVCache:
        raise ValueError("recompute re-runs the model on every window: it keeps no cache")
