"""Rotary position embeddings (GPT-NeoX / Llama "rotate-half" layout)."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_angles(pos: Int[Array, "..."], rotary_dim: int, theta: float
                ) -> tuple[Float[Array, "... r"], Float[Array, "... r"]]:
    """cos and sin of pos * inv_freq, each duplicated to ``rotary_dim`` (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [..., r/2]
    ang = jnp.concatenate([ang, ang], axis=-1)  # [..., r]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: Float[Array, "b t n h"], pos: Int[Array, "b t"], rotary_dim: int,
               theta: float) -> Float[Array, "b t n h"]:
    """Rotate the first ``rotary_dim`` dims of every head of ``x`` to positions ``pos``.

    Positions may be negative: the cache rotates keys at their (negative) offset from the chunk
    start, because only the difference between query and key positions enters the score.
    """
    if rotary_dim == 0:
        return x
    cos, sin = rope_angles(pos, rotary_dim, theta)  # [b, t, r]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)
    return out.astype(x.dtype)
