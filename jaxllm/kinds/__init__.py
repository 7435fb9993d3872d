"""Cache kinds: what a KV cache keeps and how a chunk goes through it, one module each.

* :mod:`.ring` -- :class:`Ring`: sink slots and a ring of the latest tokens (StreamingLLM,
  window attention); :class:`Dense`: every token, never wrapping;
* :mod:`.kivi` -- :class:`Kivi`: the ring in KIVI's store, whose steps read before they write;
* :mod:`.scored` -- :class:`Scored`: H2O / Q-Hitter's score-based eviction.

A kind (:class:`CacheKind`, :mod:`.base`) makes the cache, lays out a chunk, plans the
attention and returns the cache after it; the cache carries its kind (``KVCache.kind``). A
cache policy (jaxllm.policy) picks its kind; :func:`init_cache` picks one from plain settings.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ..config import ModelConfig
from ..kv.cache import KVCache, rotates_keys
from ..kv.evict import KIVI_BREAKS, Evict
from ..kv.quantized import KVQuant
from .base import CacheKind, as_int
from .kivi import Kivi
from .ring import Dense, Ring
from .scored import Scored

__all__ = ["CacheKind", "Dense", "Kivi", "Ring", "Scored", "init_cache", "kind_of"]


def kind_of(cfg: ModelConfig, sinks: int, window: int, *, ring: bool = True,
            kv_quant: Optional[KVQuant] = None, evict_by: Optional[Evict] = None) -> CacheKind:
    """The kind :func:`init_cache` makes for these settings."""
    sinks, window = as_int(sinks, "sinks"), as_int(window, "window")
    if sinks < 0:
        raise ValueError(f"sinks must be a non-negative int (0 for window attention), got "
                         f"{sinks!r}")
    quant = kv_quant or KVQuant()
    if evict_by is not None:
        if quant.format == "kivi":
            raise ValueError(f"{KIVI_BREAKS}: store keys and values as KVQuant('token') or "
                             f"KVQuant('int8') with H2O or Q-Hitter")
        return Scored(sinks, evict_by)
    if window < 1:
        raise ValueError(f"window must be an int >= 1 (the number of recent tokens kept), "
                         f"got {window!r}")
    if quant.format == "kivi":
        return Kivi(sinks, window)
    # Quantized stores keep pre-RoPE keys (jaxllm.kv.cache's note).
    return (Ring if ring else Dense)(sinks, window,
                                     keys_rotated=not quant.enabled and rotates_keys(cfg))


def init_cache(cfg: ModelConfig, batch: int, sinks: int = 4, window: int = 1020, *,
               ring: bool = True, dtype=jnp.float32, kv_quant: Optional[KVQuant] = None,
               evict_by: Optional[Evict] = None) -> KVCache:
    """An empty cache of ``sinks + window`` slots per row.

    ``init_cache(cfg, B, sinks=4, window=1020)`` is StreamingLLM's 4+1020 cache;
    ``sinks=0`` gives window attention; ``sinks=0, window=L, ring=False`` a dense cache of L tokens.
    ``dtype``: float32, bfloat16 or float16; a bfloat16 cache on CPU keeps its layers as their
    uint16 bits (jaxllm.kv.stores.Bf16Bits: XLA:CPU's bfloat16 ops are slow), elsewhere as
    bfloat16. ``kv_quant``: store keys and values in int8 or k-bit codes (jaxllm.kv.quantized;
    the sinks stay in ``dtype``), for any of these policies.
    ``evict_by``: H2O or Q-Hitter (jaxllm.kv.evict) keeping ``sinks + heavy + recent`` tokens; the
    window is then ``heavy + recent + 1`` (the extra slot takes each new token) and ``window``
    is ignored.
    """
    kind = kind_of(cfg, sinks, window, ring=ring, kv_quant=kv_quant, evict_by=evict_by)
    return kind.make(cfg, batch, dtype, kv_quant)
