"""The materialised form of attention: [T, L] scores per head, a softmax over their
concatenation, then the values. Every forward attended this way before jaxllm.attention.flash;
it stays for what needs the probabilities themselves (attention maps, H2O's accumulated scores,
SmoothQuant's INT8 products, whose probabilities are quantized per query row) and as the
blockwise form's oracle (``Kernels(attention="materialised")``)."""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..quant import QAttention, absmax_scale, pv, qk_scores
from ..rope import Rotation, apply_rope
from .flash import NEG_INF


def attend(scores_parts, value_parts, mask, cfg: ModelConfig,
           int8_att: Optional[QAttention] = None):
    """softmax over the concatenated key axis, then the weighted sum of values (GQA-aware).

    scores_parts: [B, KVH, G, T, L_i] each; value_parts: [B, KVH, L_i, Dh]; mask [B, T, sum L_i].
    Only the scores are concatenated; keys and values stay where they are. ``int8_att``: run
    the probs x values products in INT8. -> (out [B, T, H, Dh], probs [B, KVH, G, T, sum L_i]).
    """
    scores = jnp.concatenate(scores_parts, axis=-1) if len(scores_parts) > 1 else scores_parts[0]
    probs = softmax(scores, mask[:, None, None], cfg)
    p_scale = absmax_scale(probs, -1, True) if int8_att is not None else None  # one per query row
    out, start = 0.0, 0
    for v in value_parts:
        p = probs[..., start:start + v.shape[2]]
        if int8_att is not None:
            out = out + pv(p, v.astype(jnp.float32), p_scale, int8_att.real)
        else:
            out = out + jnp.einsum("bkgts,bksh->btkgh", p, v.astype(jnp.float32))
        start += v.shape[2]
    B, T = out.shape[:2]
    return out.reshape(B, T, cfg.num_heads, cfg.head_dim), probs  # [B, T, H, Dh]


def softmax(scores, mask, cfg: ModelConfig):
    """Attention probabilities over the last axis, masked keys excluded (``mask`` broadcasts)."""
    scores = jnp.where(mask, scores, NEG_INF)
    if cfg.sink == "zero":
        # softmax-off-by-one: a virtual key with score q.0 = 0 and value 0 (docs/METHODS.md §2).
        return jax.nn.softmax(jnp.concatenate([jnp.zeros_like(scores[..., :1]), scores], -1),
                              axis=-1)[..., 1:]
    return jax.nn.softmax(scores, axis=-1)


def scores(q, k, cfg: ModelConfig, int8_att: Optional[QAttention] = None):
    """q [B, T, H, Dh], k [B, KVH, L, Dh] (head-major) -> [B, KVH, G, T, L] float32, scaled."""
    B, T = q.shape[:2]
    G = cfg.queries_per_kv
    q = q.reshape(B, T, cfg.num_kv_heads, G, cfg.head_dim).astype(jnp.float32)
    if int8_att is not None:
        return qk_scores(q, k.astype(jnp.float32), int8_att.real) / math.sqrt(cfg.head_dim)
    return jnp.einsum("btkgh,bksh->bkgts", q, k.astype(jnp.float32)) / math.sqrt(cfg.head_dim)


def alibi_slopes(num_heads: int, bias_max: float) -> np.ndarray:
    """ALiBi slope per head (Press et al. 2022, as MPT builds them): 2^(-bias_max * i / H') for
    i = 1..H', H' the next power of two; for other head counts the odd then even entries."""
    n2 = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / 2.0 ** (np.arange(1, n2 + 1) * (bias_max / n2))
    if n2 != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.astype(np.float32)


def model_slopes(cfg: ModelConfig, grouped: bool = False):
    """The model's ALiBi slopes, float32: [H], or [KVH, G] by KV head with ``grouped`` (the
    layout grouped-query scores take); None without ALiBi."""
    if cfg.pos_emb != "alibi":
        return None
    s = jnp.asarray(alibi_slopes(cfg.num_heads, cfg.alibi_bias_max), jnp.float32)
    return s.reshape(cfg.num_kv_heads, cfg.queries_per_kv) if grouped else s


def part_scores(q, q_rot: Rotation, k, k_rot: Rotation, cfg: ModelConfig, int8_att=None):
    """Scores of queries [B, T, H, Dh] against head-major keys [B, KVH, L, Dh], both at
    in-cache positions: RoPE rotates both; ALiBi subtracts slope * (q_pos - k_pos), the
    contiguous in-cache distance (docs/METHODS.md §1); learned absolute positions were added to the
    input."""
    q, k = apply_rope(q, q_rot), apply_rope(k, k_rot, head_major=True)
    s = scores(q, k, cfg, int8_att)  # [B, KVH, G, T, L]
    if cfg.pos_emb == "alibi":
        slopes = model_slopes(cfg, grouped=True)
        if k_rot.pos.ndim == 3:  # per-head key positions [B, KVH, L] (score-based eviction)
            dist = q_rot.pos[:, None, None, :, None] - k_rot.pos[:, :, None, None, :]
        else:
            dist = (q_rot.pos[:, :, None] - k_rot.pos[:, None, :])[:, None, None]  # [B, T, L]
        s = s - slopes[None, :, :, None, None] * dist.astype(jnp.float32)
    return s


def within_window(q_pos, k_pos, cfg: ModelConfig):
    """Mistral's sliding window: a query sees keys less than ``sliding_window`` positions back."""
    if not cfg.sliding_window:
        return True
    return q_pos[:, :, None] - k_pos[:, None, :] < cfg.sliding_window  # [B, T, L]
