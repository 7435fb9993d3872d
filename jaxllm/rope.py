"""Rotary position embeddings (GPT-NeoX / Llama "rotate-half" layout) and their frequency scaling."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

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
    if scaling is not None and scaling.kind == "ntk":  # static NTK-aware: a larger base
        base = base * scaling.factor ** (rotary_dim / (rotary_dim - 2))
    if scaling is not None and scaling.kind == "dynamic":
        # NTK: grow the base once the sequence outgrows the pre-training length.
        L = jnp.maximum(seq_len, scaling.original_max_len).astype(jnp.float32)[:, None]
        f = scaling.factor
        base = base * (f * L / scaling.original_max_len - (f - 1)) ** (
            rotary_dim / (rotary_dim - 2))
    freq = 1.0 / base ** exps  # [B, r/2]
    if scaling is None or scaling.kind in ("dynamic", "ntk"):
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    if scaling.kind in ("yarn", "ntk-by-parts"):
        low, high = yarn_range(rotary_dim, theta, scaling.original_max_len, scaling.beta_fast,
                               scaling.beta_slow)
        i = jnp.arange(rotary_dim // 2, dtype=jnp.float32)
        ramp = jnp.clip((i - low) / ((high - low) if high > low else 0.001), 0.0, 1.0)
        return freq * (1 - ramp) + freq / scaling.factor * ramp
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


def yarn_range(rotary_dim: int, theta: float, original_max_len: int, beta_fast: float = 32.0,
               beta_slow: float = 1.0) -> tuple[int, int]:
    """YaRN's ramp bounds over dimension indices (the reference's find_correction_range):
    dimensions below ``low`` rotate more than ``beta_fast`` times over the original context and
    are kept; above ``high``, fewer than ``beta_slow`` times, and are interpolated."""
    def corr(rotations: float) -> float:
        return rotary_dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))
    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), rotary_dim - 1)


class Rotation(NamedTuple):
    """Positions [B, L] and their RoPE table (cos, sin [B, L, r/2]; None without RoPE).

    A forward computes one per position set and every layer shares it: on CPU, cos and sin of a
    4096-slot cache cost several times the rotation itself, and a layer-local table recomputed
    them in every layer."""

    pos: Int[Array, "b l"]
    cos: Optional[Float[Array, "b l r2"]] = None
    sin: Optional[Float[Array, "b l r2"]] = None

    def part(self, start: int, stop: int) -> "Rotation":
        """Positions ``start:stop`` of this set."""
        return Rotation(*(None if x is None else x[:, start:stop] for x in self))


def rotation(pos: Int[Array, "b l"], freq: Optional[Float[Array, "b r2"]],
             scale: float = 1.0) -> Rotation:
    """The table for positions ``pos`` at inverse frequencies ``freq`` (None: positions only);
    ``scale`` multiplies cos and sin (YaRN's attention temperature, applied to queries and keys
    alike, so the scores scale by its square)."""
    if freq is None or freq.shape[-1] == 0:
        return Rotation(pos)
    # [b, l, r/2], or [b, n, l, r/2] for per-head positions [b, n, l] (score-based eviction)
    freq = freq.reshape(freq.shape[:1] + (1,) * (pos.ndim - 1) + freq.shape[1:])
    ang = pos.astype(jnp.float32)[..., None] * freq
    if scale == 1.0:
        return Rotation(pos, jnp.cos(ang), jnp.sin(ang))
    return Rotation(pos, scale * jnp.cos(ang), scale * jnp.sin(ang))


def apply_rope(x: Float[Array, "b t n h"], rot: Rotation, head_major: bool = False
               ) -> Float[Array, "b t n h"]:
    """Rotate the first r dims (r = 2 * rot.cos.shape[-1]) of every head of ``x`` to the
    positions of ``rot``.

    ``x`` is [b, t, n, h], or [b, n, t, h] with ``head_major`` (the layout of cached keys).
    Positions may be negative: the cache rotates keys at their (negative) offset from the chunk
    start, because only the difference between query and key positions enters the score.
    """
    if rot.cos is None:
        return x
    rotary_dim = 2 * rot.cos.shape[-1]
    xf = x.astype(jnp.float32)
    if rot.cos.ndim == x.ndim:  # per-head tables (score-based eviction): rotate the two halves
        # with the [.., r/2] tables as they are; the same products as below, bit for bit (faster
        # on XLA:CPU for per-head tables, slower for shared ones: docs/CPU.md, "RoPE").
        half = rotary_dim // 2
        a, b, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
        out = jnp.concatenate([a * rot.cos - b * rot.sin, b * rot.cos + a * rot.sin, rest], -1)
        return out.astype(x.dtype)
    axis = 1 if head_major else 2  # broadcast over the heads axis
    cos, sin = (jnp.expand_dims(jnp.concatenate([t, t], -1), axis)  # [.., r]
                for t in (rot.cos, rot.sin))
    r, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    out = jnp.concatenate([r * cos + rotated_half * sin, rest], axis=-1)
    return out.astype(x.dtype)


def model_rotation(cfg, pos: Int[Array, "b l"], freq: Float[Array, "b r2"]) -> Rotation:
    """``rotation`` as a model ``cfg`` (jaxllm.config.ModelConfig) applies it: tables only for
    RoPE models, scaled by YaRN's attention temperature where the scaling has one."""
    m = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_scale
    return rotation(pos, freq if cfg.pos_emb == "rope" else None, scale=m)
