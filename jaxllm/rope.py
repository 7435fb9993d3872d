"""Rotary position embeddings (GPT-NeoX / Llama "rotate-half" layout) and their frequency scaling."""
from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .config import RopeScaling


def inv_freq(rotary_dim: int, theta: float, scaling: Optional[RopeScaling],
             seq_len: Int[Array, " b"]) -> Float[Array, "b r2"]:
    """Inverse frequencies per row, [B, rotary_dim / 2].

    ``seq_len`` [B] is each row's current (in-cache) sequence length; only ``dynamic`` scaling
    reads it (see :class:`jaxllm.config.RopeScaling` for the three rules).
    """
    B = seq_len.shape[0]
    exps = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim  # [r/2]
    base = jnp.full((B, 1), theta, jnp.float32)
    if scaling is not None and scaling.kind == "dynamic":
        # NTK: grow the base once the sequence outgrows the pre-training length.
        L = jnp.maximum(seq_len, scaling.original_max_len).astype(jnp.float32)[:, None]
        f = scaling.factor
        base = base * (f * L / scaling.original_max_len - (f - 1)) ** (
            rotary_dim / (rotary_dim - 2))
    freq = 1.0 / base ** exps  # [B, r/2]
    if scaling is None or scaling.kind == "dynamic":
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    # llama3: divide long wavelengths by the factor, keep short ones, interpolate in between.
    old = scaling.original_max_len
    low_wl, high_wl = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = jnp.where(wavelen > low_wl, freq / scaling.factor, freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: Float[Array, "b t n h"], pos: Int[Array, "b t"],
               freq: Float[Array, "b r2"]) -> Float[Array, "b t n h"]:
    """Rotate the first ``2 * freq.shape[-1]`` dims of every head of ``x`` to positions ``pos``.

    Positions may be negative: the cache rotates keys at their (negative) offset from the chunk
    start, because only the difference between query and key positions enters the score.
    """
    rotary_dim = 2 * freq.shape[-1]
    if rotary_dim == 0:
        return x
    ang = pos.astype(jnp.float32)[..., None] * freq[:, None, :]  # [b, t, r/2]
    ang = jnp.concatenate([ang, ang], axis=-1)  # [b, t, r]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]  # broadcast over heads
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)
    return out.astype(x.dtype)
