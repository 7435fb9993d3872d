"""Attention, one module per way a chunk meets a cache; each builds a plan once per forward
(positions, rotation tables, masks, shared by every layer) and the plan attends:

* :mod:`.plain` -- no cache: a causal forward (training, scoring);
* :mod:`.ring` -- a chunk through a sink + ring (StreamingLLM, window) or dense cache;
* :mod:`.decode` -- one token per row against the whole cache after its write (:mod:`.stored`:
  by the kernel that reads the cache as stored);
* :mod:`.kivi` -- a KIVI decode step, which reads before it writes;
* :mod:`.scored` -- H2O / Q-Hitter caches, which keep the attention paid to each key.

A cache's kind (jaxllm.kinds) chooses the plan; ``plan.attend(q, k, v, layer_cache, cfg,
int8_att, keep_probs) -> (out, new layer cache, probabilities or None)`` is the one seam the
model calls. The plain and ring forms attend blockwise (:mod:`.flash`: an online softmax over
key blocks, the Pallas kernel on GPU and TPU); :mod:`.scores` is the materialised form they
were and are tested against.
"""
from __future__ import annotations

from typing import Protocol

from . import decode, flash, kivi, plain, ring, scored
from .scores import alibi_slopes


class Plan(Protocol):
    """What the model asks of a plan (plain.Plain, ring.Ring, decode.Decode, kivi.KiviDecode,
    scored.Scored, or a kind's own)."""

    def attend(self, q, k, v, layer_cache, cfg, int8_att=None, keep_probs: bool = False):
        ...


__all__ = ["Plan", "alibi_slopes", "decode", "flash", "kivi", "plain", "ring", "scored"]
