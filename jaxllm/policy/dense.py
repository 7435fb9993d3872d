"""Dense: one cache holding the whole text, nothing evicted (the quality ceiling, and the
memory that grows with the text that StreamingLLM avoids)."""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..kinds import init_cache
from ..kv.cache import KVCache
from ..positions import check_positions
from .base import CachePolicy, KVStorage


@dataclasses.dataclass(frozen=True)
class Dense(CachePolicy):
    """Every past token; the cache is as long as the text (``slots``)."""

    storage: KVStorage = KVStorage()
    name = "dense"
    title = "dense"
    streams = False

    def slots(self, n_tokens: int) -> int:
        return n_tokens

    @property
    def label(self) -> str:
        return self.title + self.storage.describe()

    def check(self, cfg: ModelConfig, n_tokens: int) -> None:
        check_positions(cfg, n_tokens, what=f"a dense cache over {n_tokens} tokens")
        self.storage.quant.check(cfg.head_dim)

    def make_cache(self, cfg: ModelConfig, batch: int, n_tokens: int, dtype=None) -> KVCache:
        return init_cache(cfg, batch, sinks=0, window=n_tokens, ring=False,
                          dtype=self._dtype(dtype), kv_quant=self.storage.quant)
