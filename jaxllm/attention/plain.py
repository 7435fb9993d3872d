"""A plain causal forward, no cache (training, scoring, calibration): every token attends to
itself and the tokens before it, at positions 0..T-1 or the caller's (PoSE)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp
from jaxtyping import Array, Int

from ..config import ModelConfig
from ..rope import Rotation, model_rotation
from . import flash
from . import scores as sc


class Plain(NamedTuple):
    rot: Rotation  # the tokens' positions [B, T] (strictly increasing) and their tables

    def attend(self, q, k, v, layer_cache, cfg: ModelConfig, int8_att=None,
               keep_probs: bool = False):
        """q [B, T, H, Dh], k, v [B, KVH, T, Dh] -> (out [B, T, H, Dh] float32, None, the
        probabilities [B, KVH, G, T, T] if ``keep_probs`` else None)."""
        pos = self.rot.pos
        if keep_probs or int8_att is not None or flash.backend(cfg.kernels.attention) == "materialised":
            T = q.shape[1]
            mask = jnp.tril(jnp.ones((T, T), bool))[None] & sc.within_window(pos, pos, cfg)
            out, probs = sc.attend([sc.part_scores(q, self.rot, k, self.rot, cfg, int8_att)],
                                   [v], mask, cfg, int8_att)
            return out, None, probs if keep_probs else None
        # Causal in token order = by position, since positions increase along the row.
        seg = flash.Segment(q, k, v, pos, pos, jnp.ones(pos.shape, bool),
                            cfg.sliding_window or None, self.rot, self.rot)
        return flash.attend([seg], sc.model_slopes(cfg), cfg.sink == "zero",
                            cfg.kernels.attention)[0], None, None


def plan(cfg: ModelConfig, B: int, T: int, freq,
         positions: Optional[Int[Array, "b t"]] = None) -> Plain:
    pos = jnp.broadcast_to(jnp.arange(T), (B, T)) if positions is None else positions
    return Plain(model_rotation(cfg, pos, freq))
