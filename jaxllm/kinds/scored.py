"""Score-based eviction (H2O, Zhang et al. 2023, §4; Q-Hitter, Zhang et al. 2024, §3):
``sinks`` + heavy + recent slots and one free slot per row, chosen by accumulated attention
(and quantization error). The bookkeeping is jaxllm.kv.evict's (its module note: positions by
rank, a chunk attends fully and is compressed once); the attention jaxllm.attention.scored."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..attention import scored
from ..config import ModelConfig
from ..kv import evict
from .base import CacheKind


@dataclasses.dataclass(frozen=True)
class Scored(CacheKind):
    """``sinks`` + ``evict.heavy`` + ``evict.recent`` kept, one slot more for the new token."""

    sinks: int
    evict: evict.Evict

    @property
    def slots(self) -> int:
        return self.sinks + self.evict.heavy + self.evict.recent + 1

    def state(self, cfg: ModelConfig, batch: int) -> evict.Scores:
        return evict.empty_scores(batch, cfg.num_kv_heads, self.slots)

    def layout(self, cache, lens, T: int) -> evict.Layout:
        return evict.layout(cache.length, lens, T, self.sinks, self.slots - 1, self.evict)

    def plan(self, cfg: ModelConfig, lay, B: int, T: int, freq):
        return scored.plan(cfg, lay, B, T, freq)

    def advance(self, cache, lay, logits, k, v, state):
        return logits, cache.replace(k=k, v=v, state=state, length=lay.new_length)

    def score(self, forward, cache, tokens, lens):
        """One token at a time (a scan inside the same program): the kind decides what to keep
        after every token, and a chunk's tokens would see each other beyond the budget."""
        def step(c, xs):
            tok, t = xs
            logits, c = forward(c, tok[:, None], (t < lens).astype(jnp.int32), True)
            return c, logits[:, 0]

        cache, logits = jax.lax.scan(step, cache, (tokens.T, jnp.arange(tokens.shape[1])))
        return logits.transpose(1, 0, 2), cache
