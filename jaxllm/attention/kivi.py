"""A KIVI decode step by the stored-format kernel (pallas_kernels.decode): the quantized tokens
of the store's ring (jaxllm.kv.kivi) are read as codes, keys per channel and values per token,
dequantized and turned (RoPE after dequantizing) in registers. KIVI reads before it writes: the
step attends to the cache as it was plus its own token in full precision, then quantizes.

The kernel takes the tokens whose key and value are both quantized: those more than R back
(the R most recent values are read in full). The rest is attended here, a handful of rows: the
sinks, the R most recent tokens (values from the full-precision ring; keys from the incomplete
block's full-precision copy, or dequantized from their codes), and the step's own token.

Positions as the chunk path (jaxllm.attention.ring): the query at 0, the token d back at -d. In
the store's ring offset o holds the token d = (head - 1 - o) mod W' + 1 back, so the kernel turns
each key to its offset o and the query to ``head`` (offsets below the head: this lap) or
``head + W'`` (the last lap), and each slot's score is the one its lap picks.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax.numpy as jnp
from jaxtyping import Array

from pallas_kernels import decode as kernel

from ..config import ModelConfig
from ..kv import cache as kvc
from ..kv.kivi import KiviKeys, KiviValues
from ..kv.quantized import unpack
from ..rope import apply_rope, model_rotation
from . import flash, ring, stored


class KiviDecode(NamedTuple):
    chunk: ring.Ring  # the XLA form (any store, any backend) and the sinks' positions
    freq: Optional[Array]  # RoPE's inverse frequencies [B, r/2]

    def attend(self, q, k, v, layer_cache, cfg: ModelConfig, int8_att=None,
               keep_probs: bool = False):
        ck, cv = layer_cache
        if int8_att is not None or not usable(cfg, ck, cv):
            return self.chunk.attend(q, k, v, layer_cache, cfg, int8_att, keep_probs)
        out = attend(q, k, v, ck, cv, self, cfg)
        lay = self.chunk.lay
        return out, (kvc.write_layer(ck, k, lay), kvc.write_layer(cv, v, lay)), None


def plan(cfg: ModelConfig, lay: kvc.ChunkLayout, B: int, sinks: int, freq) -> KiviDecode:
    return KiviDecode(ring.plan(cfg, lay, B, 1, sinks, freq), freq)


def layouts(ck: KiviKeys):
    s = ck.spec
    return kernel.Layout("channel", s.bits, s.group), kernel.Layout("token", s.bits, s.group)


def usable(cfg: ModelConfig, ck, cv) -> bool:
    """The kernel reads the store (KIVI with float minima, whole words, power-of-two groups) at
    this model's head dim, and the attention kernel is chosen (jaxllm.attention.flash)."""
    if not (isinstance(ck, KiviKeys) and isinstance(cv, KiviValues)):
        return False
    if flash.backend(cfg.kernels.attention) != "pallas" or ck.spec.zero_point != "float":
        return False
    rope = cfg.pos_emb == "rope" and cfg.rotary_dim > 0
    if rope and cfg.rotary_dim != cfg.head_dim:
        return False
    kl, vl = layouts(ck)
    return kernel.supports(kl, vl, cfg.head_dim, rope, ck.codes.shape[2], kl.group) is None


def _recent_keys(ck: KiviKeys, offsets, d):
    """The keys at store offsets [B, R'] (d tokens back), float32 [B, KVH, R', D]: from the
    incomplete block's full-precision copy where they are in it, else dequantized."""
    s, R, G, D = ck.spec, ck.spec.residual, ck.spec.group, ck.head_dim
    take = lambda a, idx: jnp.take_along_axis(a, idx[:, None, :, None], axis=2)  # noqa: E731
    codes = take(ck.codes, offsets)
    x = (unpack(codes, s.bits, D) if s.packed else codes).astype(jnp.float32)
    per = 32 // s.bits if s.packed else 1
    side = lambda a: kernel.unpermute(take(a, offsets // G).astype(jnp.float32), per)  # noqa
    deq = x * side(ck.scale) + side(ck.offset)
    full = take(ck.resid, jnp.mod(offsets, R)).astype(jnp.float32)
    in_block = d <= jnp.mod(ck.head, R)[:, None]
    return jnp.where(in_block[:, None, :, None], full, deq)


def attend(q, k, v, ck: KiviKeys, cv: KiviValues, p: KiviDecode, cfg: ModelConfig):
    """q [B, 1, H, Dh], the step's k, v [B, KVH, 1, Dh] (pre-RoPE), the layer's stores before
    the step -> out [B, 1, H, Dh] float32."""
    B, _, H, Dh = q.shape
    KVH, G = cfg.num_kv_heads, cfg.queries_per_kv
    N, lay = B * KVH, p.chunk.lay
    R, Wp, W = ck.spec.residual, ck.codes.shape[2], ck.window
    S = ck.sinks.shape[2]
    span = min(W, cfg.sliding_window) if cfg.sliding_window else W
    reach = jnp.minimum(lay.ring_count, span - 1)[:, None]  # the farthest token visible
    rot = lambda pos: model_rotation(cfg, pos, p.freq)  # noqa: E731
    rope = cfg.pos_emb == "rope" and cfg.rotary_dim > 0
    alibi = cfg.pos_emb == "alibi"
    slopes = stored.slopes_of(cfg, B)
    by_head = lambda a: jnp.repeat(a, KVH, axis=0)  # noqa: E731  [B, ...] -> [N, ...]
    scale = 1.0 / math.sqrt(Dh)

    def rows(rotation):  # the query at the rotation's positions [B, R'] -> [N, R', G, Dh]
        r = rotation.pos.shape[1]
        x = apply_rope(jnp.broadcast_to(q, (B, r, H, Dh)), rotation).astype(jnp.float32)
        return (x * scale).reshape(B, r, KVH, G, Dh).transpose(0, 2, 1, 3, 4).reshape(
            N, r, G, Dh)

    # The kernel: offsets more than R back and within reach.
    head = ck.head[:, None]  # [B, 1]
    o = jnp.arange(Wp, dtype=jnp.int32)[None, :]
    d = jnp.mod(head - 1 - o, Wp) + 1  # [B, W']
    pick = jnp.where((d > R) & (d <= reach), jnp.where(o < head, 0, 1), -1)
    laps = jnp.concatenate([head, head + Wp], axis=1)  # [B, 2]
    turn = None
    if rope:
        turn = kernel.Rope(p.freq, 0, 1.0 if cfg.rope_scaling is None
                           else cfg.rope_scaling.attention_scale)
    kl, vl = layouts(ck)
    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    parts = [stored.partials(rows(rot(laps)), kl, (flat(ck.codes), flat(ck.scale),
                                                   flat(ck.offset)),
                             vl, (flat(cv.codes), flat(cv.scale), flat(cv.offset)), pick,
                             d if alibi else None, slopes, turn)]

    # Here: the R most recent tokens, the step's own, the sinks.
    q0 = rows(p.chunk.q)[:, 0]  # at 0
    dr = jnp.broadcast_to(jnp.arange(1, R + 1, dtype=jnp.int32)[None, :], (B, R))
    keys = _recent_keys(ck, jnp.mod(head - dr, Wp), dr)  # [B, KVH, R, Dh]
    keys = apply_rope(keys, rot(-dr), head_major=True)
    vals = jnp.take_along_axis(cv.resid, jnp.mod(cv.rhead[:, None] - dr, R + 1)[
        :, None, :, None], axis=2)
    own = apply_rope(k.astype(ck.dtype).astype(jnp.float32), p.chunk.keys.part(
        p.chunk.keys.pos.shape[1] - 1, p.chunk.keys.pos.shape[1]), head_major=True)
    keys = jnp.concatenate([keys, own], axis=2)
    vals = jnp.concatenate([vals, v.astype(cv.dtype)], axis=2)
    dist = jnp.concatenate([dr, jnp.zeros((B, 1), jnp.int32)], axis=1)
    ok = jnp.concatenate([dr <= reach, lay.chunk_ok], axis=1)  # (a token that is a sink: there)
    parts.append(stored.dense_state(q0, keys.reshape(N, R + 1, Dh), vals.reshape(N, R + 1, Dh),
                                    by_head(ok), by_head(dist) if alibi else None, slopes))
    if S:
        ks = kvc.merge_sinks(ck.sinks, k.astype(ck.dtype), lay, S)
        vs = kvc.merge_sinks(cv.sinks, v.astype(cv.dtype), lay, S)
        ks = apply_rope(ks.astype(jnp.float32), p.chunk.k_sink, head_major=True)
        qs = rows(p.chunk.q_sink)[:, 0]
        sink_dist = lay.sink_q_pos - jnp.arange(S, dtype=jnp.int32)[None, :]
        parts.append(stored.dense_state(qs, ks.reshape(N, S, Dh), vs.reshape(N, S, Dh),
                                        by_head(lay.sink_mask[:, 0]),
                                        by_head(sink_dist) if alibi else None, slopes))
    if cfg.sink == "zero":
        parts.append(stored.virtual_zero(N, G, Dh))
    return stored.fold(parts).reshape(B, 1, H, Dh)
