"""The transformer: Flax modules that take the KV cache as an argument and return the new one."""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

import pallas_kernels.cpu
from pallas_kernels.reference import computed_once

from . import cache as kvc
from . import evict
from .config import ModelConfig
from .policy import check_positions
from .quant import (QAttention, QKernel, absmax_scale, in_widened_groups, pv, qk_scores,
                    qmatmul, widen)
from .rope import Rotation, apply_rope, inv_freq
from .rope import rotation as _rotation

NEG_INF = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


class Linear(nn.Module):
    """y = x @ kernel (+ bias); kernel [in, out]. Params stay float32, compute in ``dtype``."""

    features: int
    use_bias: bool
    std: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        # The input's per-channel max |x|, collected only when "intermediates" is mutable
        # (SmoothQuant calibration); otherwise dead code that XLA drops.
        self.sow("intermediates", "in_absmax",
                 jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0),
                 reduce_fn=lambda a, b: b, init_fn=lambda: 0.0)
        kernel = self.get_variable("params", "kernel")
        if isinstance(kernel, QKernel):  # INT8 (jaxllm.quant): dispatch on the leaf's type
            y = qmatmul(x, kernel, self.dtype)
        else:
            kernel = self.param("kernel", nn.initializers.normal(self.std),
                                (x.shape[-1], self.features))
            y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
        return y


class Embed(nn.Module):
    """Token embedding [vocab, dim]; ``attend`` is the tied output head. An int8 table
    (``QKernel`` with per-row scales) dequantizes the looked-up rows and runs the head in INT8."""

    vocab: int
    dim: int
    std: float

    @nn.compact
    def __call__(self, tokens):
        table = self.get_variable("params", "embedding")
        if isinstance(table, QKernel):  # int8 rows, one scale each
            return table.q[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
        table = self.param("embedding", nn.initializers.normal(self.std), (self.vocab, self.dim))
        return table[tokens]

    def attend(self, x, vocab: int):
        """Logits over the first ``vocab`` rows (a learnable sink's row is input-only)."""
        table = self.get_variable("params", "embedding")
        if isinstance(table, QKernel):  # the table is [vocab, dim] = [out, in]
            return qmatmul(x, table.replace(q=table.q[:vocab], scale=table.scale[:vocab]),
                           jnp.float32)
        return jnp.einsum("...d,vd->...v", x, table[:vocab])


class Norm(nn.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale only), computed in float32."""

    kind: str
    eps: float
    use_bias: bool = True  # LayerNorm only

    @nn.compact
    def __call__(self, x):
        xf = x.astype(jnp.float32)
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if self.kind == "rmsnorm":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps) * scale
        else:
            mu = jnp.mean(xf, -1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
            y = (xf - mu) * jax.lax.rsqrt(var + self.eps) * scale
            if self.use_bias:
                y = y + self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        return y.astype(x.dtype)


def _attend(scores_parts, value_parts, mask, cfg: ModelConfig,
            int8_att: Optional[QAttention] = None):
    """softmax over the concatenated key axis, then the weighted sum of values (GQA-aware).

    scores_parts: [B, KVH, G, T, L_i] each; value_parts: [B, KVH, L_i, Dh]; mask [B, T, sum L_i].
    Only the (small) scores are concatenated; keys and values stay where they are, so a decode
    step never copies the cache. ``int8_att``: run the probs x values products in INT8.
    """
    scores = jnp.concatenate(scores_parts, axis=-1) if len(scores_parts) > 1 else scores_parts[0]
    probs = _softmax(scores, mask[:, None, None], cfg)
    p_scale = absmax_scale(probs, -1, True) if int8_att is not None else None  # one per query row
    out, start = 0.0, 0
    for v in value_parts:
        p = probs[..., start:start + v.shape[2]]
        # (XLA:CPU transposes the values here, a pass over V per step. Asking for the product's
        # natural order [B, KVH, G, T, Dh] avoids that but makes it copy the donated cache
        # instead, which costs as much.)
        if int8_att is not None:
            out = out + pv(p, v.astype(jnp.float32), p_scale, int8_att.real)
        else:
            out = out + jnp.einsum("bkgts,bksh->btkgh", p, v.astype(jnp.float32))
        start += v.shape[2]
    B, T = out.shape[:2]
    return out.reshape(B, T, cfg.num_heads, cfg.head_dim), probs  # [B, T, H, Dh]


def _softmax(scores, mask, cfg: ModelConfig):
    """Attention probabilities over the last axis, masked keys excluded (``mask`` broadcasts)."""
    scores = jnp.where(mask, scores, NEG_INF)
    if cfg.sink == "zero":
        # softmax-off-by-one: a virtual key with score q.0 = 0 and value 0 (REFERENCE §2).
        return jax.nn.softmax(jnp.concatenate([jnp.zeros_like(scores[..., :1]), scores], -1),
                              axis=-1)[..., 1:]
    return jax.nn.softmax(scores, axis=-1)


def _decode_probs(s, pick, mask, dist, cfg: ModelConfig, slopes=None):
    """A decode step's attention probabilities from scores s [B, K, R, G, C] (R: the query's
    rotations; ``pick`` [B, C] names the one each slot keeps), ``mask`` [B, C], ALiBi
    distances ``dist`` [B, C] (None without ALiBi) with ``slopes`` [B, G] (default: the
    model's, [K, G], K = the KV heads) -> [B, K, G, C]."""
    s = s / math.sqrt(cfg.head_dim)
    R = s.shape[2]
    if R > 1:
        p = pick[:, None, None, :]
        s = jnp.where(p == 0, s[:, :, 0], jnp.where(p == 1, s[:, :, 1], s[:, :, 2]))
    else:
        s = s[:, :, 0]
    if dist is not None:
        if slopes is None:
            G = cfg.num_heads // cfg.num_kv_heads
            slopes = jnp.asarray(alibi_slopes(cfg.num_heads, cfg.alibi_bias_max),
                                 jnp.float32).reshape(1, cfg.num_kv_heads, G)
        else:
            slopes = slopes[:, None]  # [B, 1, G]
        s = s - slopes[..., None] * dist[:, None, None, :].astype(jnp.float32)
    return _softmax(s, mask[:, None, None, :], cfg)


def use_attention_kernel(k: Array) -> bool:
    """Whether a decode step's attention over keys ``k`` [N, C, Dh] goes to the CPU kernel
    (pallas_kernels.cpu.decode_attention): on CPU where it is built and this CPU runs it, for
    the cache dtypes it reads and head dims up to its limit (pallas_kernels.cpu)."""
    return (k.shape[-1] <= pallas_kernels.cpu.MAX_HEAD_DIM
            and k.dtype in pallas_kernels.cpu.ATTENTION_DTYPES
            and pallas_kernels.cpu.attention_available())


def _decode_attend(q, k, v, plan: "AttnPlan", cfg: ModelConfig,
                   int8_att: Optional[QAttention] = None):
    """One query per row against the whole cache after the step's write (cache.token_view).

    q [B, 1, H, Dh]; k, v [B * KVH, C, Dh] (cache.write_token's reads: float arrays, or the
    uint16 bits of a bfloat16 cache on CPU, cache.Bf16Bits; 2-byte ones are widened a few
    heads at a time, quant.in_widened_groups). The query is rotated at its three
    positions (sinks, this lap, last lap), all three are scored against every slot in one
    product, and each slot keeps the score ``plan.pick`` names: the keys are read once and,
    when stored rotated, never rotated again.
    """
    B, _, H, Dh = q.shape
    KVH, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    C = k.shape[1]
    rope = plan.q.cos is not None
    R = 3 if rope else 1  # without RoPE the three positions give the same query
    q = apply_rope(jnp.broadcast_to(q, (B, R, H, Dh)), plan.q.part(0, R))
    if plan.keys.cos is not None or int8_att is not None:  # these read float keys (and values)
        k, v = widen(k), widen(v)
    if plan.keys.cos is not None:  # pre-RoPE keys (quantized stores, dynamic NTK)
        k = apply_rope(k.reshape(B, KVH, C, Dh), plan.keys, head_major=True).reshape(k.shape)
    q = q.reshape(B, R, KVH, G, Dh)
    if int8_att is not None:
        s = qk_scores(q.astype(jnp.float32), k.reshape(B, KVH, C, Dh).astype(jnp.float32),
                      int8_att.real).transpose(0, 1, 3, 2, 4)  # [B, KVH, R, G, C]
        probs = _decode_probs(s, plan.pick, plan.mask[:, 0],
                              plan.dist if cfg.pos_emb == "alibi" else None, cfg)  # [B,KVH,G,C]
        p = probs[:, :, :, None]  # [B, KVH, G, 1, C]
        out = pv(p, v.reshape(B, KVH, C, Dh).astype(jnp.float32), absmax_scale(p, -1, True),
                 int8_att.real)
        return out.reshape(B, 1, H, Dh)
    rows, N = R * G, B * KVH
    qm = q.transpose(0, 2, 1, 3, 4).reshape(N, rows, Dh).astype(jnp.float32)  # row r * G + g
    alibi = cfg.pos_emb == "alibi"
    slopes = jnp.tile(jnp.asarray(alibi_slopes(cfg.num_heads, cfg.alibi_bias_max) if alibi
                                  else np.zeros(H), jnp.float32).reshape(KVH, G), (B, 1))
    mask = jnp.broadcast_to(plan.mask[:, 0], (B, C))

    def by_kernel(k, v, qm):
        # The CPU kernel (pallas_kernels/csrc/decode_attention.cc): each head's keys and values
        # read once, 2-byte ones widened in registers, each slot scored against the one
        # rotation it keeps. Pythia-160M's layer at 4,096 slots: 0.4 ms against 1.2 (float32)
        # and 3.5 (bfloat16); docs/BENCHMARKS.md, "KV cache passes".
        pick = jnp.where(mask, plan.pick if R > 1 else 0, -1)
        return pallas_kernels.cpu.decode_attention(
            k, v, qm, pick, G, dist=plan.dist if alibi else None,
            slopes=slopes if alibi else None, zero_sink=cfg.sink == "zero")

    def by_xla(k, v, qm):
        return _decode_attend_xla(k, v, qm, plan, mask, slopes, R, cfg)

    if use_attention_kernel(k):
        out = pallas_kernels.cpu.on_cpu(by_kernel, by_xla, k, v, qm)
    else:
        out = by_xla(k, v, qm)
    return out.reshape(B, 1, H, Dh)


def _decode_attend_xla(k, v, qm, plan: "AttnPlan", mask, slopes, R: int, cfg: ModelConfig):
    """``_decode_attend``'s pass by XLA: k, v [N, C, Dh] (N = B * KVH), the query rows qm
    [N, R * G, Dh] -> [N, G, Dh]."""
    N, C, _ = k.shape
    KVH, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    rows, alibi = R * G, cfg.pos_emb == "alibi"
    # Scores, softmax and values for a few heads at a time, in one pass: a 2-byte cache is
    # widened a group of heads at a time (quant.in_widened_groups), keys and values together,
    # and no [B * KVH, C] scores array lives between two loops. As two loops (scores, then
    # values) each layer's scores were a loop's output, which XLA:CPU gave its own memory:
    # 77 MiB of temporaries a step at 4+4092, batch 8, mapped fresh each step (21,500 page
    # faults); in one pass, 5 MiB.
    #
    # The keys are the left operand and the query rows are padded to a multiple of 4: XLA:CPU
    # hands a product of several query rows to YNNPACK, which took 2.7 ms per layer for 3 rows
    # at 4096 slots and 1.2 in this form (Pythia-160M, 4+4092, batch 1: 64 ms a step against
    # 45-50, and 42 for one row alone, which would be wrong).
    qm = jnp.pad(qm, ((0, 0), (0, -rows % 4 if rows > 1 else 0), (0, 0)))

    def by_head(a):  # [B, ...] -> [B * KVH, ...], row b * KVH + h
        return jnp.broadcast_to(a[:, None], (a.shape[0], KVH) + a.shape[1:]).reshape(
            N, *a.shape[1:])
    mask = by_head(mask)
    pick = by_head(plan.pick) if R > 1 else mask  # (unused without RoPE)
    dist = by_head(plan.dist) if alibi else mask  # (unused without ALiBi)

    def attend(k, v, qm, mask, pick, dist, slopes):  # the rows of some heads -> [n, G, Dh]
        n = k.shape[0]
        s = jax.lax.dot_general(k, qm, (((2,), (2,)), ((0,), (0,))),
                                preferred_element_type=jnp.float32)  # [n, C, rows + pad]
        s = s[..., :rows].transpose(0, 2, 1).reshape(n, 1, R, G, C)
        probs = _decode_probs(s, pick, mask, dist if alibi else None, cfg, slopes)[:, 0]
        return jnp.einsum("nrs,nsh->nrh", probs, v)
    return in_widened_groups(attend, (k, v), qm, mask, pick, dist, slopes)


def _scores(q, k, cfg: ModelConfig, int8_att: Optional[QAttention] = None):
    """q [B, T, H, Dh], k [B, KVH, L, Dh] (head-major) -> [B, KVH, G, T, L] float32, scaled."""
    B, T = q.shape[:2]
    G = cfg.num_heads // cfg.num_kv_heads
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


def _part_scores(q, q_rot: Rotation, k, k_rot: Rotation, cfg: ModelConfig,
                 int8_att=None):
    """Scores of queries [B, T, H, Dh] against head-major keys [B, KVH, L, Dh], both at
    in-cache positions: RoPE rotates both; ALiBi subtracts slope * (q_pos - k_pos), the
    contiguous in-cache distance (REFERENCE §1); learned absolute positions were added to the
    input."""
    q, k = apply_rope(q, q_rot), apply_rope(k, k_rot, head_major=True)
    s = _scores(q, k, cfg, int8_att)  # [B, KVH, G, T, L]
    if cfg.pos_emb == "alibi":
        G = cfg.num_heads // cfg.num_kv_heads
        slopes = alibi_slopes(cfg.num_heads, cfg.alibi_bias_max).reshape(cfg.num_kv_heads, G)
        if k_rot.pos.ndim == 3:  # per-head key positions [B, KVH, L] (score-based eviction)
            dist = q_rot.pos[:, None, None, :, None] - k_rot.pos[:, :, None, None, :]
        else:
            dist = (q_rot.pos[:, :, None] - k_rot.pos[:, None, :])[:, None, None]  # [B, T, L]
        s = s - slopes[None, :, :, None, None] * dist.astype(jnp.float32)
    return s


def _within_window(q_pos, k_pos, cfg: ModelConfig):
    """Mistral's sliding window: a query sees keys less than ``sliding_window`` positions back."""
    if not cfg.sliding_window:
        return True
    return q_pos[:, :, None] - k_pos[:, None, :] < cfg.sliding_window  # [B, T, L]


class AttnPlan(NamedTuple):
    """Where every query and key of a forward sits: in-cache positions with their RoPE tables,
    and the mask over [sink keys | other keys]. Computed once per forward, shared by all layers.

    ``keys``: the non-sink keys in the order they are scored: 0..T-1 without a cache; the cache
    slots then the chunk (T > 1). A decode step (T == 1, ``pick`` set) scores every slot, sinks
    included, after its token is written: ``q`` then holds the query's three positions, ``keys``
    the slots' positions (a table only for keys stored before RoPE), ``mask`` is [B, 1, S+W].
    """

    q: Rotation  # queries, for the non-sink keys [B, T]
    keys: Rotation  # [B, L]
    mask: Bool[Array, "b t l"]  # [B or 1, T, S + L]
    q_sink: Optional[Rotation] = None  # queries at min(t, S+W-1), for the sink keys
    k_sink: Optional[Rotation] = None  # sink keys at 0..S-1
    rotate: Optional[Callable] = None  # positions -> Rotation, for per-head key positions
    store: Optional[Rotation] = None  # the chunk's keys at their slots' positions (keys_rotated)
    # decode (cache.token_view): q holds the query's three positions, keys the slots'
    pick: Optional[Int[Array, "b c"]] = None
    dist: Optional[Int[Array, "b c"]] = None


def attn_plan(cfg: ModelConfig, lay: Optional[kvc.ChunkLayout], B: int, T: int, sinks: int,
              freq, write_first: bool = True, positions=None,
              keys_rotated: bool = False) -> AttnPlan:
    """The plan of a plain causal forward (``lay`` None; at ``positions`` [B, T], default
    0..T-1) or of a chunk of ``T`` tokens through a cache with ``sinks`` sink slots; ``freq``
    [B, r/2] the RoPE inverse frequencies; ``keys_rotated``: the cache stores its keys rotated
    at their slots' positions (jaxllm.cache's note)."""
    fr = freq if cfg.pos_emb == "rope" else None
    m = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_scale
    rotation = functools.partial(_rotation, scale=m)
    if isinstance(lay, evict.Layout):  # score-based: keys at their rank, per head (evict.py)
        # Each layer and KV head places its keys differently: their cos/sin rows are gathered
        # from one table of positions 0..C+T-1 per forward (a row gather; cos and sin of every
        # slot in every layer cost more than the rest of the decode step on CPU).
        P = lay.keep + 1 + T
        table = rotation(jnp.broadcast_to(jnp.arange(P), (B, P)), fr)
        if table.cos is not None:
            table = Rotation(table.pos, computed_once(table.cos), computed_once(table.sin))

        def rotate(pos):  # [B, KVH, L] -> Rotation with [B, KVH, L, r/2] tables
            if table.cos is None:
                return Rotation(pos)
            rows = jax.vmap(lambda t, i: t[i])  # per batch row: [P, r/2][KVH, L]
            return Rotation(pos, rows(table.cos, pos), rows(table.sin, pos))
        rot = rotation(lay.pos, fr)
        return AttnPlan(rot, rot, lay.chunk_mask & _within_window(lay.pos, lay.pos, cfg),
                        rotate=rotate)
    if lay is None:  # plain causal forward (causal in token order)
        pos = jnp.broadcast_to(jnp.arange(T), (B, T)) if positions is None else positions
        rot = rotation(pos, fr)
        mask = jnp.tril(jnp.ones((T, T), bool))[None] & _within_window(pos, pos, cfg)
        return AttnPlan(rot, rot, mask)
    store = rotation(lay.store_pos, fr) if keys_rotated else None
    C = lay.ring_k_pos.shape[1]
    if T == 1 and write_first:  # decode: the token is written, then the cache alone is read
        view = kvc.token_view(lay, sinks)
        mask = view.mask
        if cfg.sliding_window:  # Mistral's window, over the non-sink slots
            mask = mask & ((jnp.arange(C) < sinks) | (view.dist < cfg.sliding_window))[:, None]
        k_pos = jnp.broadcast_to(view.k_pos, (B, C))
        keys = Rotation(k_pos) if keys_rotated else rotation(k_pos, fr)
        return AttnPlan(rotation(view.q_pos, fr), keys, mask, store=store, pick=view.pick,
                        dist=view.dist)
    k_pos = jnp.concatenate([lay.ring_k_pos, lay.chunk_k_pos], axis=1)
    mask = lay.rest_mask & _within_window(lay.rest_q_pos, k_pos, cfg)
    if keys_rotated:  # turn keys stored at their slots' positions to their chunk-relative
        # ones: a rotation by the difference, unscaled (YaRN's scale is in the stored keys)
        keys = _rotation(k_pos - jnp.concatenate(
            [jnp.broadcast_to(kvc.slot_positions(sinks, C - sinks), (B, C)), lay.store_pos], 1),
            fr)
    else:
        keys = rotation(k_pos, fr)
    plan = AttnPlan(rotation(lay.rest_q_pos, fr), keys, mask, store=store)
    if not sinks:
        return plan
    sink_pos = jnp.broadcast_to(jnp.arange(sinks), (B, sinks))
    k_sink = Rotation(sink_pos) if keys_rotated else rotation(sink_pos, fr)  # stored at j
    return plan._replace(q_sink=rotation(lay.sink_q_pos, fr), k_sink=k_sink,
                         mask=jnp.concatenate([lay.sink_mask, mask], axis=-1))


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, lay: Optional[kvc.ChunkLayout], plan: AttnPlan):
        cfg = self.cfg
        B, T, _ = x.shape
        dt = _dtype(cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

        def proj(heads, name):
            y = Linear(heads * cfg.head_dim, cfg.attn_bias, cfg.init_std, dt, name=name)(x)
            if cfg.qkv_clip:
                y = jnp.clip(y, -cfg.qkv_clip, cfg.qkv_clip)
            return y.reshape(B, T, heads, cfg.head_dim)  # [B, T, heads, Dh]

        # Keys and values head-major [B, KVH, T, Dh], the cache's layout: a decode step then reads
        # each head's keys as one contiguous [L, Dh] matrix instead of transposing the cache.
        q = proj(cfg.num_heads, "q")
        k, v = (proj(cfg.num_kv_heads, n).transpose(0, 2, 1, 3) for n in ("k", "v"))
        int8_att = self.get_variable("params", "int8_attention")  # QAttention: INT8 QKᵀ and PV (SmoothQuant)

        if isinstance(lay, evict.Layout):
            ctx, new_cache = _scored_attention(q, k, v, layer_cache, lay, plan, cfg, int8_att)
        elif lay is None:  # plain causal forward
            ctx, probs = _attend([_part_scores(q, plan.q, k, plan.keys, cfg, int8_att)], [v],
                                 plan.mask, cfg, int8_att)
            # Attention maps for analysis (jaxllm.evals.attention), kept only when the
            # "attention" collection is mutable (calibration's "intermediates" never pays for it).
            self.sow("attention", "probs", probs.reshape(B, cfg.num_heads, T, T),
                     reduce_fn=lambda a, b: b, init_fn=lambda: 0.0)
            new_cache = None
        else:
            ck, cv = layer_cache  # float arrays, or quantized stores (jaxllm.kvquant)
            if plan.store is not None:  # the cache keeps keys rotated at their slots' positions
                k = apply_rope(k, plan.store, head_major=True)
            if plan.pick is not None:  # decode: write the token, then read the cache alone
                # (no copy, see cache.token_view); a longer chunk (and KIVI, which attends
                # before it quantizes) must read the old cache first, since later tokens
                # overwrite ring slots that earlier tokens still attend to.
                (nk, rk), (nv, rv) = kvc.write_token(ck, k, lay), kvc.write_token(cv, v, lay)
                ctx, new_cache = _decode_attend(q, rk, rv, plan, cfg, int8_att), (nk, nv)
            else:
                S = 0 if plan.k_sink is None else plan.k_sink.pos.shape[1]
                new_cache = kvc.write_layer(ck, k, lay), kvc.write_layer(cv, v, lay)
                # What is attended to is exactly what is cached (its dtype, its quantization),
                # so a chunk and the token-by-token process see identical keys and values.
                k_ring, v_ring = kvc.as_stored(ck, k), kvc.as_stored(cv, v)
                ck, cv = kvc.read_layer(ck, lay), kvc.read_layer(cv, lay)
                k, v = k.astype(ck.dtype), v.astype(cv.dtype)  # sinks: full precision
                C = ck.shape[2]
                scores = [_part_scores(q, plan.q, ck, plan.keys.part(0, C), cfg, int8_att),
                          _part_scores(q, plan.q, k_ring, plan.keys.part(C, C + T), cfg,
                                       int8_att)]
                values = [cv, v_ring]
                if S:
                    sink_k = kvc.merge_sinks(ck, k, lay, S)  # [B, KVH, S, Dh]
                    scores.insert(0, _part_scores(q, plan.q_sink, sink_k, plan.k_sink, cfg,
                                                  int8_att))
                    values.insert(0, kvc.merge_sinks(cv, v, lay, S))
                ctx, _ = _attend(scores, values, plan.mask, cfg, int8_att)
        ctx = ctx.reshape(B, T, cfg.num_heads * cfg.head_dim).astype(dt)
        return Linear(cfg.hidden_size, cfg.attn_bias, out_std, dt, name="o")(ctx), new_cache


def _scored_attention(q, k, v, layer_cache, lay: evict.Layout, plan: AttnPlan,
                      cfg: ModelConfig, int8_att):
    """Attention through an H2O / Q-Hitter cache (jaxllm.evict): each KV head's kept keys sit
    at their own ranks; the attention paid to every key is added to its score, then the cache
    evicts (one token per decode step, or compresses after a chunk)."""
    ck, cv, sc = layer_cache
    B, T = q.shape[:2]
    spec, S = lay.spec, lay.sinks
    if spec.uses_error:  # Q-Hitter: what storing each key and value loses
        err = jnp.stack([evict.token_error(x, functools.partial(kvc.as_stored, store))
                         for x, store in ((k, ck), (v, cv))], -1)
    else:
        err = jnp.zeros(k.shape[:3] + (2,))
    err = jnp.where((lay.pos < S)[:, None, :, None], 0.0, err)  # sinks stay in full precision

    def cache_scores(keys, sc):
        s = _part_scores(q, plan.q, keys, plan.rotate(sc.rank), cfg, int8_att)
        ok = sc.rank >= 0  # [B, KVH, C1]
        if cfg.sliding_window:
            ok = ok & (lay.pos[:, None, :, None] - sc.rank[:, :, None, :] < cfg.sliding_window)
            ok = ok[:, :, None]  # [B, KVH, 1, T, C1]
        else:
            ok = ok[:, :, None, None]
        return jnp.where(ok, s, NEG_INF)

    active = lay.lens > 0
    if T == 1:  # decode: write the token into the free slot, attend over all, evict one
        bi, hi = jnp.meshgrid(jnp.arange(B), jnp.arange(k.shape[1]), indexing="ij")
        slot = jnp.where(active[:, None], sc.free, ck.shape[2])  # out of range: not written

        def scatter(arr, rows):
            return arr.at[bi, hi, slot].set(rows[:, :, 0].astype(arr.dtype), mode="drop")

        ck, cv = kvc.write_layer(ck, k, None, scatter), kvc.write_layer(cv, v, None, scatter)
        sc = evict.written(sc, lay.n, active, err[:, :, 0])
        keys, values = kvc.read_layer(ck, None), kvc.read_layer(cv, None)
        C1 = keys.shape[2]
        ctx, probs = _attend([cache_scores(keys, sc)], [values], jnp.ones((B, 1, C1), bool),
                             cfg, int8_att)
        sc = evict.decode_update(sc, probs, lay.n, active, spec, S)
        return ctx, (ck, cv, sc)
    # A chunk: attend to what is kept and to its own tokens as they will be stored (a token
    # that becomes a sink stays in full precision), then compress.
    keys, values = kvc.read_layer(ck, None), kvc.read_layer(cv, None)
    C1 = keys.shape[2]
    sink = (lay.pos < S)[:, None, :, None]
    k_st = jnp.where(sink, k.astype(keys.dtype), kvc.as_stored(ck, k))
    v_st = jnp.where(sink, v.astype(values.dtype), kvc.as_stored(cv, v))
    scores = [cache_scores(keys, sc), _part_scores(q, plan.q, k_st, plan.keys, cfg, int8_att)]
    mask = jnp.concatenate([jnp.ones((B, T, C1), bool), plan.mask], -1)
    ctx, probs = _attend(scores, [values, v_st], mask, cfg, int8_att)
    p = jnp.sum(jnp.where(lay.valid[:, None, None, :, None], probs, 0.0), axis=(2, 3))
    sc, idx = evict.compress(sc, p[..., :C1], p[..., C1:], err, lay, spec)
    return ctx, (kvc.select_slots(ck, k, idx), kvc.select_slots(cv, v, idx), sc)


ACTIVATIONS = {"gelu": lambda h: jax.nn.gelu(h, approximate=False),
               "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
               "relu": jax.nn.relu}


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.cfg, _dtype(self.cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        up = Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt, name="up")
        if cfg.mlp == "swiglu":
            gate = Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt, name="gate")(x)
            h = jax.nn.silu(gate) * up(x)
        else:
            h = ACTIVATIONS[cfg.mlp](up(x))
        return Linear(cfg.hidden_size, cfg.mlp_bias, out_std, dt, name="down")(h)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, lay, plan: AttnPlan):
        cfg = self.cfg
        ln1 = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="ln_attn")
        ln2 = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="ln_mlp")
        attn = Attention(cfg, name="attn")
        mlp = MLP(cfg, name="mlp")
        if not cfg.pre_norm:  # post-LN (OPT-350m): normalise after each residual add
            a, new_cache = attn(x, layer_cache, lay, plan)
            h = ln1(x + a)
            return ln2(h + mlp(h)), new_cache
        h1 = ln1(x)
        a, new_cache = attn(h1, layer_cache, lay, plan)
        if cfg.parallel_residual:  # x + Attn(LN1 x) + MLP(LN2 x), or one shared LN (Falcon-7B)
            return x + a + mlp(h1 if cfg.shared_norm else ln2(x)), new_cache
        h = x + a
        return h + mlp(ln2(h)), new_cache


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, cache: Optional[kvc.KVCache], lay: Optional[kvc.ChunkLayout],
                 positions: Optional[Int[Array, "b t"]] = None):
        cfg = self.cfg
        B, T = tokens.shape
        dt = _dtype(cfg)
        embed = Embed(cfg.embed_rows, cfg.embedding_dim, cfg.init_std, name="embed")
        x = embed(tokens).astype(dt)
        if cfg.embedding_dim != cfg.hidden_size:  # OPT: embeddings narrower than the model
            x = Linear(cfg.hidden_size, False, cfg.init_std, dt, name="project_in")(x)
        if cfg.pos_emb == "learned":  # absolute positions (dense caches only, see check_chunk)
            pos = jnp.arange(T)[None] + (0 if cache is None else cache.length[:, None])
            pos = pos if positions is None else positions
            pos = jnp.minimum(pos, cfg.max_seq_len - 1)  # padding past the table is never read
            x = x + nn.Embed(cfg.max_seq_len, cfg.hidden_size,
                             embedding_init=nn.initializers.normal(cfg.init_std),
                             name="pos_embed")(pos).astype(dt)
        # RoPE frequencies, positions, tables and masks once per forward, shared by all layers;
        # only dynamic NTK scaling depends on the length.
        seq_len = jnp.full((B,), T, jnp.int32) if lay is None else lay.new_length
        if isinstance(lay, evict.Layout):  # what the last query sees: kept + the chunk
            seq_len = lay.n + lay.lens
        if positions is not None:  # explicit positions: the sequence reaches the largest + 1
            seq_len = jnp.max(positions, axis=1).astype(jnp.int32) + 1
        freq = inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, seq_len)
        plan = attn_plan(cfg, lay, B, T, 0 if cache is None else cache.sinks, freq,
                         write_first=cache is None or not kvc.reads_before_write(cache.k[0]),
                         positions=positions, keys_rotated=cache is not None and cache.keys_rotated)
        new_k, new_v, new_s = [], [], []
        for layer in range(cfg.num_layers):
            layer_cache = None if cache is None else (cache.k[layer], cache.v[layer]) + \
                cache.scores[layer:layer + 1]  # + the layer's evict.Scores if score-based
            x, nc = Block(cfg, name=f"layer_{layer}")(x, layer_cache, lay, plan)
            if nc is not None:
                new_k.append(nc[0])
                new_v.append(nc[1])
                new_s.extend(nc[2:])
        if cfg.final_norm:
            x = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="ln_final")(x)
        if cfg.embedding_dim != cfg.hidden_size:
            x = Linear(cfg.embedding_dim, False, cfg.init_std, dt, name="project_out")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x.astype(jnp.float32), cfg.vocab_size)
        else:
            logits = Linear(cfg.vocab_size, False, cfg.init_std, dt, name="lm_head")(x)
        return logits.astype(jnp.float32), (tuple(new_k), tuple(new_v), tuple(new_s))


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Random parameters (normal(init_std), output projections scaled by 1/sqrt(2L))."""
    return Transformer(cfg).init(key, jnp.zeros((1, 1), jnp.int32), None, None)["params"]


def apply(params, cfg: ModelConfig, tokens: Int[Array, "b t"],
          cache: Optional[kvc.KVCache] = None, lens: Optional[Int[Array, " b"]] = None, *,
          mutable=(), positions: Optional[Int[Array, "b t"]] = None):
    """The model as a traceable function: ``(logits [B, T, V] float32, cache)``.

    The one way every module runs the model inside its own ``jit`` (generate's loop, ppl's
    scoring, calibration, attention maps, the training loss, the benchmarks); it does no input
    checking, so call :func:`forward` (checked, jitted) from plain Python. ``cache=None``: a
    plain causal forward at positions 0..T-1 (the cache returned is None); with a cache,
    ``lens`` [B] are the valid tokens per row (int32). ``mutable`` (plain forward only): flax
    collections to collect, e.g. ``["intermediates"]`` (each linear's input maxima, for
    SmoothQuant's calibration) or ``["attention"]`` (attention probabilities); the result is
    then ``(logits, None, state)``. ``positions`` [B, T] (plain forward only): each token's
    position id, increasing along the row (PoSE's skipped positions); default 0..T-1.
    """
    if cache is None:
        if not mutable:
            return Transformer(cfg).apply({"params": params}, tokens, None, None,
                                          positions)[0], None
        (logits, _), state = Transformer(cfg).apply({"params": params}, tokens, None, None,
                                                    positions, mutable=list(mutable))
        return logits, None, state
    if mutable or positions is not None:
        raise ValueError("mutable collections and explicit positions apply to a plain forward "
                         "(cache=None); with a cache, positions are assigned within the cache")
    B, T = tokens.shape
    W = cache.window
    # Score-based eviction prefills as its authors do: the whole chunk attends fully, then is
    # compressed once (jaxllm.evict), so its positions reach C + T (bounded by the chunk).
    if T <= W or cache.evict_by is not None:
        return _forward_chunk(params, cfg, tokens, cache, lens)
    # A chunk longer than the window goes through in blocks of W tokens (a scan inside the same
    # jit). Within a chunk, queries and keys are rotated at their chunk offsets, so a long chunk
    # would put positions up to T into the float32 angles, which are coarse there (the error grew
    # with the offset, 20x the token-by-token path's at 4,096). In blocks of W every rotated
    # position lies in [-W, W) whatever T is, and the logits are the same (chunking never changes
    # them); the scores also shrink to W x (S + 2W) per block from T x (S + W + T).
    n = -(-T // W)
    blocks = jnp.pad(tokens, ((0, 0), (0, n * W - T))).reshape(B, n, W).transpose(1, 0, 2)
    block_lens = jnp.clip(lens[None, :] - W * jnp.arange(n, dtype=lens.dtype)[:, None], 0, W)

    def step(c, xs):
        logits, c = _forward_chunk(params, cfg, xs[0], c, xs[1])
        return c, logits

    cache, logits = jax.lax.scan(step, cache, (blocks, block_lens))  # logits [n, B, W, V]
    return logits.transpose(1, 0, 2, 3).reshape(B, n * W, -1)[:, :T], cache


def _forward_chunk(params, cfg: ModelConfig, tokens, cache, lens):
    """One chunk of at most ``cache.window`` tokens (any length with score-based eviction)
    through the cache."""
    if cache.evict_by is not None:  # H2O / Q-Hitter (jaxllm.evict)
        lay = evict.layout(cache.length, lens, tokens.shape[1], cache.sinks,
                           cache.capacity - 1, cache.evict_by)
        logits, (ks, vs, ss) = Transformer(cfg).apply({"params": params}, tokens, cache, lay)
        return logits, cache.replace(k=ks, v=vs, scores=ss, length=lay.new_length)
    lay = kvc.chunk_layout(cache, lens, tokens.shape[1])
    logits, (ks, vs, _) = Transformer(cfg).apply({"params": params}, tokens, cache, lay)
    # A dense cache asked to overflow: under jit we cannot raise, so the row's logits become NaN
    # (outside jit, forward() raises before getting here).
    logits = jnp.where(lay.overflow[:, None, None], jnp.nan, logits)
    new_cache = cache.replace(k=ks, v=vs, length=lay.new_length, head=lay.new_head)
    return logits, new_cache


_forward_jit = jax.jit(apply, static_argnames=("cfg",))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_token_ids(cfg: ModelConfig, tokens) -> None:
    """Token ids must index the embedding (``embed_rows``: the vocabulary, plus a learnable
    sink's row). Out-of-range ids would be clamped silently by the gather; under a caller's own
    jit they are (the check needs concrete values), so check before jitting."""
    ids = np.asarray(jax.device_get(tokens))
    bad = (ids < 0) | (ids >= cfg.embed_rows)
    if bad.any():
        b, t = map(int, np.argwhere(bad)[0])
        raise ValueError(f"token id {int(ids[b, t])} at row {b}, position {t} is outside the "
                         f"model's vocabulary [0, {cfg.embed_rows}); does the tokenizer match the "
                         f"model? ({int(bad.sum())} bad ids in all)")


def check_chunk(cfg: ModelConfig, tokens, cache: Optional[kvc.KVCache], lengths) -> jax.Array:
    """Validate a forward call's inputs; returns per-row valid lengths [B] (int32)."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    B, T = tokens.shape
    if T == 0:
        raise ValueError("the chunk is empty (tokens of shape [batch, 0]): pass at least one token")
    if _is_concrete(tokens):
        check_token_ids(cfg, tokens)
    if lengths is None:
        lens = jnp.full((B,), T, jnp.int32)
    else:
        lens = jnp.asarray(lengths, jnp.int32)
        if lens.shape != (B,):
            raise ValueError(f"lengths must have shape [batch]=({B},), got {tuple(lens.shape)}")
        if _is_concrete(lens):
            lo, hi = int(lens.min()), int(lens.max())
            if lo < 0 or hi > T:
                raise ValueError(f"lengths must lie in [0, {T}] (valid tokens per row of this "
                                 f"chunk), got values in [{lo}, {hi}]")
    if cache is None:
        check_positions(cfg, "dense", T)
    else:
        check_positions(cfg, "streaming" if cache.evict or cache.sinks else "dense",
                        cache.capacity)
    if cache is None:
        if lengths is not None:
            raise ValueError("lengths (right padding) only applies to a forward with a cache; "
                             "a plain causal forward is unaffected by trailing padding")
        return lens
    if cache.batch != B:
        raise ValueError(f"tokens have batch {B} but the cache was made for batch {cache.batch}; "
                         f"use init_cache(cfg, batch={B}, ...)")
    kv_shape = cache.k[0].shape
    if (kv_shape[1], kv_shape[3]) != (cfg.num_kv_heads, cfg.head_dim) or \
            len(cache.k) != cfg.num_layers:
        raise ValueError("the cache does not match this ModelConfig (layers/kv heads/head dim); "
                         "make it with init_cache(cfg, ...) for the same cfg")
    if cache.keys_rotated and not kvc.rotates_keys(cfg):
        raise ValueError("the cache stores its keys rotated (a RoPE model with fixed "
                         "frequencies) but this ModelConfig's positions differ; make it with "
                         "init_cache(cfg, ...) for the same cfg")
    if _is_concrete(cache.length) and _is_concrete(lens):
        kvc.check_room(cache, jax.device_get(cache.length + lens))
    return lens


def forward(params, cfg: ModelConfig, tokens: Int[Array, "b t"],
            cache: Optional[kvc.KVCache] = None, lengths: Optional[Int[Array, " b"]] = None,
            positions: Optional[Int[Array, "b t"]] = None
            ) -> tuple[Float[Array, "b t v"], Optional[kvc.KVCache]]:
    """Logits for ``tokens`` and the updated cache.

    ``cache=None``: a plain causal forward at positions 0..T-1 (the cache returned is None).
    With a cache: the chunk (any length, also longer than the window) continues each row's
    stream; ``lengths`` [B] marks how many leading tokens of each row are real (the rest is padding,
    never written, with undefined logits). Every token's logits equal those of feeding the stream
    one token at a time through a cache trimmed to S+W after each token.
    ``positions`` [B, T] (plain forward only): explicit position ids, strictly increasing along
    each row (training with skipped positions, PoSE); attention stays causal in token order.
    """
    tokens = jnp.asarray(tokens)
    lens = check_chunk(cfg, tokens, cache, lengths)
    if positions is None:
        return _forward_jit(params, cfg, tokens.astype(jnp.int32), cache, lens)
    positions = check_positions_arg(cfg, tokens, cache, positions)
    return _forward_positions_jit(params, cfg, tokens.astype(jnp.int32), positions)


_forward_positions_jit = jax.jit(lambda p, cfg, t, pos: apply(p, cfg, t, positions=pos),
                                 static_argnums=1)


def check_positions_arg(cfg: ModelConfig, tokens, cache, positions) -> jax.Array:
    """Explicit positions: a plain forward only, [B, T] integers, non-negative, strictly
    increasing along each row, and within a learned position table."""
    if cache is not None:
        raise ValueError("positions apply to a plain forward (cache=None); a cache assigns "
                         "positions within itself")
    pos = jnp.asarray(positions)
    if pos.shape != tokens.shape or not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"positions must be integers of the tokens' shape {tuple(tokens.shape)},"
                         f" got {pos.dtype} {tuple(pos.shape)}")
    if _is_concrete(pos):
        p = np.asarray(pos)
        if (p < 0).any() or (np.diff(p, axis=1) <= 0).any():
            raise ValueError("positions must be >= 0 and strictly increasing along each row")
        check_positions(cfg, "dense", int(p.max()) + 1)
    return pos.astype(jnp.int32)
