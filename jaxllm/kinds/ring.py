"""Sink slots and a ring (StreamingLLM, Xiao et al. 2023, §3.2; window attention with no
sinks) and the dense cache, which never wraps. The slot arithmetic and the in-cache positions
are jaxllm.kv.cache's (its module note); the attention is jaxllm.attention.ring for a chunk
and jaxllm.attention.decode for a one-token step, which writes its token before it reads."""
from __future__ import annotations

import dataclasses
import math
import jax.numpy as jnp
import numpy as np

from ..attention import decode, ring
from ..config import ModelConfig
from ..kv import cache as kvc
from .base import CacheKind

# The rows (batch x tokens) of one prefill block: a long chunk goes through the cache in blocks
# of at most this many rows, so its activations (the MLP's, the projections', the attention
# output) are bounded whatever the prompt's length. 4,096 rows keep every product large.
PREFILL_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class Ring(CacheKind):
    """``sinks`` slots for the stream's first tokens and a ring of ``window`` for the latest."""

    sinks: int
    window: int
    keys_rotated: bool = False  # jaxllm.kv.cache's note, "Keys stored rotated"

    @property
    def slots(self) -> int:
        return self.sinks + self.window

    def layout(self, cache, lens, T: int) -> kvc.ChunkLayout:
        return kvc.chunk_layout(cache, lens, T)

    def plan(self, cfg: ModelConfig, lay, B: int, T: int, freq):
        if T == 1:  # a decode step: its token written first, then the whole cache read
            return decode.plan(cfg, lay, B, self.sinks, freq, self.keys_rotated)
        return ring.plan(cfg, lay, B, T, self.sinks, freq, self.keys_rotated)

    def advance(self, cache, lay, logits, k, v, state):
        return logits, cache.replace(k=k, v=v, length=lay.new_length, head=lay.new_head)

    def prefill_block(self, batch: int) -> int:
        """At most the window (a ring holds no more at once) and PREFILL_ROWS / batch (a power
        of two, at least 16). In blocks of at most the window, every rotated position lies in
        [-W, W) whatever the chunk's length (float32 angles are coarse further out)."""
        return min(self.window,
                   max(16, 2 ** int(math.log2(max(1, PREFILL_ROWS // batch)))))

    def bucket(self, T: int, batch: int) -> int:
        """A power of two up to 256 (at least 16), then a multiple of 256; past one prefill
        block, whole blocks (the blockwise prefill runs whole blocks anyway)."""
        blk = self.prefill_block(batch)
        b = max(16, 1 << (T - 1).bit_length()) if T <= 256 else -(-T // 256) * 256
        return -(-T // blk) * blk if b > blk else b


@dataclasses.dataclass(frozen=True)
class Dense(Ring):
    """Every token kept, ``window`` slots in all: writing past the end is an error (refused
    before a call; under a caller's own jit the row's logits become NaN)."""

    streams = False  # positions are the stream's own

    def layout(self, cache, lens, T: int) -> kvc.ChunkLayout:
        lay = kvc.chunk_layout(cache, lens, T)
        return lay._replace(overflow=cache.length + lens > self.slots)

    def advance(self, cache, lay, logits, k, v, state):
        logits = jnp.where(lay.overflow[:, None, None], jnp.nan, logits)
        return super().advance(cache, lay, logits, k, v, state)

    def bucket(self, T: int, batch: int) -> int:
        """As the ring's, never past the cache's size."""
        return max(T, min(super().bucket(T, batch), self.slots))

    def check_room(self, cache, need) -> None:
        need = np.asarray(need)
        if (need > self.slots).any():
            raise ValueError(f"dense cache overflow: a row would hold {int(need.max())} tokens "
                             f"but the cache has {self.slots} slots; make a larger dense cache "
                             f"or use a streaming cache (init_cache(cfg, B, sinks=4, window=W))")

