"""Attention, one module per cache kind; each builds a plan once per forward (positions,
rotation tables, masks, shared by every layer) and the plan attends:

* :mod:`.plain` -- no cache: a causal forward (training, scoring);
* :mod:`.ring` -- a chunk through a sink + ring (StreamingLLM, window) or dense cache;
* :mod:`.decode` -- one token per row against the whole cache after its write (:mod:`.stored`:
  by the kernel that reads the cache as stored);
* :mod:`.kivi` -- a KIVI decode step, which reads before it writes;
* :mod:`.scored` -- H2O / Q-Hitter caches, which keep the attention paid to each key.

The plain and ring forms attend blockwise (:mod:`.flash`: an online softmax over key blocks,
the Pallas kernel on GPU and TPU); :mod:`.scores` is the materialised form they were and are
tested against. ``plan(...).attend(q, k, v, layer_cache, cfg, int8_att)`` is the one seam the
model calls.
"""
from __future__ import annotations

from typing import Union

from ..kv import evict
from ..config import ModelConfig
from . import decode, flash, kivi, plain, ring, scored
from .scores import alibi_slopes

Plan = Union[plain.Plain, ring.Ring, decode.Decode, kivi.KiviDecode, scored.Scored]


def plan(cfg: ModelConfig, lay, B: int, T: int, sinks: int, freq, write_first: bool = True,
         positions=None, keys_rotated: bool = False) -> Plan:
    """The plan for ``lay``: None (a plain forward at ``positions`` [B, T], default 0..T-1), a
    cache's ChunkLayout (a decode step when T == 1 and the store is written before it is read,
    ``write_first``; else a chunk) or an evict.Layout. ``freq`` [B, r/2]: RoPE's inverse
    frequencies; ``keys_rotated``: the cache stores its keys rotated (jaxllm.kv.cache's note)."""
    if lay is None:
        return plain.plan(cfg, B, T, freq, positions)
    if isinstance(lay, evict.Layout):
        return scored.plan(cfg, lay, B, T, freq)
    if T == 1 and write_first:
        return decode.plan(cfg, lay, B, sinks, freq, keys_rotated)
    if T == 1:  # a store that reads before it writes: KIVI
        return kivi.plan(cfg, lay, B, sinks, freq)
    return ring.plan(cfg, lay, B, T, sinks, freq, keys_rotated)


__all__ = ["Plan", "plan", "alibi_slopes", "decode", "flash", "plain", "ring", "scored"]
