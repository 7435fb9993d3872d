"""A decode step: one query per row against the whole cache after its token is written
(jaxllm.kv.cache's token_view). The scores of one row are small, so this is the materialised
form, in one pass over each head's keys and values: the CPU kernel where it is built
(pallas_kernels.cpu.decode_attention), XLA's form elsewhere."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

import pallas_kernels.cpu

from ..kv import cache as kvc
from ..config import ModelConfig
from ..bits import in_widened_groups, widen
from ..quant import QAttention, absmax_scale, pv, qk_scores
from ..rope import Rotation, apply_rope, model_rotation
from . import scores as sc
from . import stored


class Decode(NamedTuple):
    """The step's query at its three positions (sinks, this lap, last lap) and the slots'."""

    lay: kvc.ChunkLayout
    q: Rotation  # [B, 3]
    keys: Rotation  # the slots' positions [B, C] (a table only for keys stored before RoPE)
    mask: Bool[Array, "b 1 c"]
    pick: Int[Array, "b c"]  # which of the three query positions scores each slot
    dist: Int[Array, "b c"]  # the in-cache distance that gives (ALiBi)
    store: Optional[Rotation] = None  # the token's key at its slot's position (keys_rotated)
    sinks: int = 0
    freq: Optional[Array] = None  # RoPE's inverse frequencies [B, r/2] (the kernel turns keys)

    def attend(self, q, k, v, layer_cache, cfg: ModelConfig, int8_att=None,
               keep_probs: bool = False):
        """q [B, 1, H, Dh], k, v [B, KVH, 1, Dh]: write the token, then read the cache alone
        (no copy, see cache.token_view) -> (out [B, 1, H, Dh], the new (keys, values), None).
        A longer chunk (and KIVI, which attends before it quantizes) reads the old cache first
        (jaxllm.attention.ring), since later tokens overwrite ring slots earlier ones see."""
        ck, cv = layer_cache
        if self.store is not None:  # the cache keeps keys rotated at their slots' positions
            k = apply_rope(k, self.store, head_major=True)
        if int8_att is None and stored.usable(cfg, ck, cv, self.keys.cos is not None):
            nk, nv = kvc.write_layer(ck, k, self.lay), kvc.write_layer(cv, v, self.lay)
            return stored.attend(q, nk, nv, self, cfg, self.sinks, self.freq), (nk, nv), None
        (nk, rk), (nv, rv) = kvc.write_token(ck, k, self.lay), kvc.write_token(cv, v, self.lay)
        return attend_cache(q, rk, rv, self, cfg, int8_att), (nk, nv), None


def plan(cfg: ModelConfig, lay: kvc.ChunkLayout, B: int, sinks: int, freq,
         keys_rotated: bool = False) -> Decode:
    rotation = lambda pos: model_rotation(cfg, pos, freq)
    C = lay.ring_k_pos.shape[1]
    view = kvc.token_view(lay, sinks)
    mask = view.mask
    if lay.lens is not None:  # a row the step leaves alone attends to nothing: the CPU kernel
        mask = mask & (lay.lens > 0)[:, None, None]  # then reads none of its cache
    if cfg.sliding_window:  # Mistral's window, over the non-sink slots
        mask = mask & ((jnp.arange(C) < sinks) | (view.dist < cfg.sliding_window))[:, None]
    k_pos = jnp.broadcast_to(view.k_pos, (B, C))
    keys = Rotation(k_pos) if keys_rotated else rotation(k_pos)
    return Decode(lay, rotation(view.q_pos), keys, mask, view.pick, view.dist,
                  store=rotation(lay.store_pos) if keys_rotated else None, sinks=sinks,
                  freq=freq)


def step_probs(s, pick, mask, dist, cfg: ModelConfig, slopes=None):
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
            slopes = sc.model_slopes(cfg, grouped=True)[None]
        else:
            slopes = slopes[:, None]  # [B, 1, G]
        s = s - slopes[..., None] * dist[:, None, None, :].astype(jnp.float32)
    return sc.softmax(s, mask[:, None, None, :], cfg)


def use_attention_kernel(k: Array) -> bool:
    """Whether a decode step's attention over keys ``k`` [N, C, Dh] goes to the CPU kernel
    (pallas_kernels.cpu.decode_attention): on CPU where it is built and this CPU runs it, for
    the cache dtypes it reads and head dims up to its limit (pallas_kernels.cpu)."""
    return (k.shape[-1] <= pallas_kernels.cpu.MAX_HEAD_DIM
            and k.dtype in pallas_kernels.cpu.ATTENTION_DTYPES
            and pallas_kernels.cpu.attention_available())


def attend_cache(q, k, v, plan: "Decode", cfg: ModelConfig,
                 int8_att: Optional[QAttention] = None):
    """One query per row against the whole cache after the step's write (cache.token_view).

    q [B, 1, H, Dh]; k, v [B * KVH, C, Dh] (cache.write_token's reads: float arrays, or the
    uint16 bits of a bfloat16 cache on CPU, kv.stores.Bf16Bits; 2-byte ones are widened a few
    heads at a time, bits.in_widened_groups). The query is rotated at its three
    positions (sinks, this lap, last lap), all three are scored against every slot in one
    product, and each slot keeps the score ``plan.pick`` names: the keys are read once and,
    when stored rotated, never rotated again.
    """
    B, _, H, Dh = q.shape
    KVH, G = cfg.num_kv_heads, cfg.queries_per_kv
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
        probs = step_probs(s, plan.pick, plan.mask[:, 0],
                           plan.dist if cfg.pos_emb == "alibi" else None, cfg)  # [B,KVH,G,C]
        p = probs[:, :, :, None]  # [B, KVH, G, 1, C]
        out = pv(p, v.reshape(B, KVH, C, Dh).astype(jnp.float32), absmax_scale(p, -1, True),
                 int8_att.real)
        return out.reshape(B, 1, H, Dh)
    rows, N = R * G, B * KVH
    qm = q.transpose(0, 2, 1, 3, 4).reshape(N, rows, Dh).astype(jnp.float32)  # row r * G + g
    alibi = cfg.pos_emb == "alibi"
    slopes = jnp.tile(sc.model_slopes(cfg, grouped=True) if alibi
                      else jnp.zeros((KVH, G), jnp.float32), (B, 1))
    mask = jnp.broadcast_to(plan.mask[:, 0], (B, C))

    def by_kernel(k, v, qm):
        # The CPU kernel (pallas_kernels/csrc/decode_attention.cc): each head's keys and values
        # read once, 2-byte ones widened in registers, each slot scored against the one
        # rotation it keeps (its speed: docs/BENCHMARKS.md, "KV cache passes").
        pick = jnp.where(mask, plan.pick if R > 1 else 0, -1)
        return pallas_kernels.cpu.decode_attention(
            k, v, qm, pick, G, dist=plan.dist if alibi else None,
            slopes=slopes if alibi else None, zero_sink=cfg.sink == "zero")

    def by_xla(k, v, qm):
        return _attend_xla(k, v, qm, plan, mask, slopes, R, cfg)

    if cfg.kernels.attention == "auto" and use_attention_kernel(k):
        out = pallas_kernels.cpu.on_cpu(by_kernel, by_xla, k, v, qm)
    else:
        out = by_xla(k, v, qm)
    return out.reshape(B, 1, H, Dh)


def _attend_xla(k, v, qm, plan: "Decode", mask, slopes, R: int, cfg: ModelConfig):
    """``attend_cache``'s pass by XLA: k, v [N, C, Dh] (N = B * KVH), the query rows qm
    [N, R * G, Dh] -> [N, G, Dh]."""
    N, C, _ = k.shape
    KVH, G = cfg.num_kv_heads, cfg.queries_per_kv
    rows, alibi = R * G, cfg.pos_emb == "alibi"
    # Scores, softmax and values for a few heads at a time, in one pass: a 2-byte cache is
    # widened a group of heads at a time (bits.in_widened_groups), keys and values together,
    # and no [B * KVH, C] scores array lives between two loops. As two loops (scores, then
    # values) each layer's scores were a loop's output, which XLA:CPU gave its own memory,
    # mapped fresh each step.
    #
    # The keys are the left operand and the query rows are padded to a multiple of 4: XLA:CPU
    # hands a product of several query rows to YNNPACK, which is slower at these shapes
    # (docs/CPU.md, "Decode attention in XLA").
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
        probs = step_probs(s, pick, mask, dist if alibi else None, cfg, slopes)[:, 0]
        return jnp.einsum("nrs,nsh->nrh", probs, v)
    return in_widened_groups(attend, (k, v), qm, mask, pick, dist, slopes)
