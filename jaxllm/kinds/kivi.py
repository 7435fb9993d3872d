"""KIVI's cache (Liu et al. 2024, §3.2, Algorithm 1): sinks and a ring whose store
(jaxllm.kv.kivi) quantizes keys a block of R tokens at a time and keeps the latest values in
full precision. A step attends to the cache as it was before the step plus its own tokens,
and quantizes afterwards, so a decode step reads before it writes (jaxllm.attention.kivi)."""
from __future__ import annotations

import dataclasses

from ..attention import kivi, ring
from ..config import ModelConfig
from ..kv.kivi import empty_kivi
from .ring import Ring


@dataclasses.dataclass(frozen=True)
class Kivi(Ring):
    """A ring of ``window`` beside ``sinks`` slots, in KIVI's store (keys before RoPE)."""

    def store(self, cfg: ModelConfig, batch: int, dtype, kv_quant, values: bool):
        return empty_kivi(kv_quant, batch, cfg.num_kv_heads, self.slots, self.sinks,
                          cfg.head_dim, dtype, values)

    def plan(self, cfg: ModelConfig, lay, B: int, T: int, freq):
        if T == 1:
            return kivi.plan(cfg, lay, B, self.sinks, freq)
        return ring.plan(cfg, lay, B, T, self.sinks, freq)
