"""KIVI's KV-cache storage ("KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
Liu et al. 2024, Section 3.2 and Algorithm 1): keys quantized per channel over groups of G
tokens, values per token over groups of G channels, the most recent tokens in full precision.

**Its own ring.** Keys are quantized a block of R (the residual) tokens at a time, so blocks must
not straddle the wrap of a ring. The stores therefore keep the non-sink tokens in a ring of their
own, ``W' = ceil(W / R)·R`` slots (W the cache's window), indexed by their own counter ``head``
(non-sink tokens written, mod W'): any window works (4 + 4092 with R = 32 keeps 4,096 slots),
and tokens older than the window that still sit in the last W' - W slots are never visible.
Non-sink token u sits at offset u mod W'; :meth:`KiviKeys.read` and :meth:`KiviValues.read`
gather the cache's view (slot S + i holds the token (head_cache - 1 - i) mod W + 1 back) from it.

Keys: a block's keys stay in full precision in ``resid`` (offset u mod R) until its last token
arrives, and are then quantized per channel in groups of G tokens (KIVI's flush of R keys, R/G
groups); scales and minima are kept in the codes' channel order (pallas_kernels.decode.permute),
as the decode kernel reads them. Values: every token's value is quantized per token when
written; the R most recent are also kept in full precision in a ring of R + 1 slots (``resid``,
its own head ``rhead``), and attention reads those in full: KIVI's sliding window of exactly R.

Timing, as the authors' code: a step attends to the cache as it was before the step plus the
step's own tokens in full precision, and quantizes afterwards. So a decode step sees the R
previous values and its own (R + 1) in full, and the keys of the current incomplete block; a
prompt fed in one chunk attends in full precision throughout (their prefill is fp16
flash-attention), and one fed in several chunks sees the earlier chunks as quantized: chunked
prefill equals token-by-token only in what is stored, not in the prompt's own logits.

Eviction: the oldest tokens leave the window one by one. A key group whose first tokens left
keeps its scale and minimum for its remaining members (the newcomers are read from ``resid``
until their block completes, which then rewrites the whole group).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from pallas_kernels.decode import permute, unpermute

from .quantized import KVQuant, _codes, dequantize, pack, quantize, unpack


def ring_size(window: int, residual: int) -> int:
    """W': the window rounded up to whole blocks of R."""
    return -(-window // residual) * residual


def token_offsets(lay, head: Int[Array, " b"], W: int, Wp: int) -> Int[Array, "b w"]:
    """The store's offset of the token in each ring slot of the cache's view (slot S + i), from
    the cache's head before the chunk (``lay.old_head``) and the store's ``head``."""
    i = jnp.arange(W, dtype=jnp.int32)[None, :]
    d = jnp.mod(lay.old_head[:, None] - 1 - i, W) + 1  # tokens back from the chunk
    return jnp.mod(head[:, None] - d, Wp)


def _gather(x: Float[Array, "b n w h"], idx: Int[Array, "b v"]) -> Float[Array, "b n v h"]:
    return jnp.take_along_axis(x, idx[:, None, :, None], axis=2)


class _View:
    """What attention sees: [B, KVH, S + window, D] in the sinks' float dtype."""

    @property
    def head_dim(self) -> int:
        return self.sinks.shape[3]

    @property
    def shape(self) -> tuple:
        return self.codes.shape[:2] + (self.sinks.shape[2] + self.window, self.head_dim)

    @property
    def dtype(self):
        return self.sinks.dtype


    def stored(self, chunk):
        return chunk.astype(self.dtype)  # a step attends to its own tokens in full precision


@struct.dataclass
class KiviKeys(_View):
    """codes [B, KVH, W', P] (per token, packed along channels), scale/offset [B, KVH, W'/G, D]
    (per group of G tokens and channel, in the codes' channel order), resid [B, KVH, R, D],
    sinks [B, KVH, S, D], head [B] (the next offset)."""

    codes: Array
    scale: Array
    offset: Array
    resid: Array
    sinks: Array
    head: Array
    spec: KVQuant = struct.field(pytree_node=False)
    window: int = struct.field(pytree_node=False, default=0)

    def dequantized(self) -> Float[Array, "b n w h"]:
        """Every offset's key from its codes, float32 [B, KVH, W', D]."""
        D, G, per = self.head_dim, self.spec.group, 32 // self.spec.bits
        q = unpack(self.codes, self.spec.bits, D) if self.spec.packed else self.codes
        B, H, Wp, _ = q.shape
        side = lambda a: unpermute(a.astype(jnp.float32), per if self.spec.packed else 1)  # noqa
        y = q.reshape(B, H, Wp // G, G, D).astype(jnp.float32) * side(self.scale)[:, :, :, None] \
            + side(self.offset)[:, :, :, None]
        return y.reshape(B, H, Wp, D)

    def full(self) -> Float[Array, "b n w h"]:
        """Every offset's key as attention reads it before a chunk: the incomplete block from
        ``resid`` (full precision), the rest dequantized."""
        R = self.spec.residual
        deq = self.dequantized()
        Wp = deq.shape[2]
        o = jnp.arange(Wp, dtype=jnp.int32)[None, :]
        head = self.head[:, None]
        in_block = (o >= head - jnp.mod(head, R)) & (o < head)
        resid = jnp.tile(self.resid.astype(jnp.float32), (1, 1, Wp // R, 1))  # o -> o mod R
        return jnp.where(in_block[:, None, :, None], resid, deq)

    def read(self, lay) -> Float[Array, "b n c h"]:
        Wp = self.codes.shape[2]
        ring = _gather(self.full(), token_offsets(lay, self.head, self.window, Wp))
        return jnp.concatenate([self.sinks, ring.astype(self.dtype)], axis=2)

    def write(self, chunk, lay, scatter) -> "KiviKeys":
        R, G, D = self.spec.residual, self.spec.group, self.head_dim
        B, H, T, _ = chunk.shape
        Wp = self.codes.shape[2]
        head, n = self.head[:, None], lay.n_nonsink[:, None]  # [B, 1]
        k0 = jnp.mod(head, R)  # tokens of the incomplete block before the chunk
        blk0 = head - k0  # its offset
        # E: the incomplete block's tokens then the chunk's non-sink tokens, in stream order.
        L = -(-(R + T) // G) * G
        p = jnp.arange(L, dtype=jnp.int32)[None, :]  # [1, L]
        from_resid = p < k0
        r_idx = jnp.minimum(p, R - 1)
        c_idx = jnp.clip(p - k0 + lay.first_nonsink[:, None], 0, T - 1)
        pick = lambda a, idx: jnp.take_along_axis(a, idx[:, None, :, None], axis=2)  # noqa
        E = jnp.where(from_resid[:, None, :, None],
                      pick(self.resid.astype(jnp.float32), jnp.broadcast_to(r_idx, (B, L))),
                      pick(chunk.astype(jnp.float32), c_idx))  # [B, H, L, D]
        total = k0 + n
        done = (total // R) * R  # E positions in completed blocks: quantized now
        # Per channel over G consecutive tokens: quantize E's transpose along tokens.
        Eg = E.reshape(B, H, L // G, G, D).transpose(0, 1, 2, 4, 3)  # [B, H, L/G, D, G]
        q, scale, offset = quantize(Eg, self.spec.per_token)  # groups = the last axis (G)
        q = q.transpose(0, 1, 2, 4, 3).reshape(B, H, L, D)
        per = 32 // self.spec.bits if self.spec.packed else 1
        scale, offset = permute(scale[..., 0], per), permute(offset[..., 0], per)  # [B,H,L/G,D]
        if self.spec.packed:
            q = pack(q, self.spec.bits)
        keep = (p < done) & (p >= total - Wp)  # quantized, and not overwritten by the chunk
        slot = jnp.where(keep, jnp.mod(blk0 + p, Wp), Wp)  # Wp: dropped
        b_idx = jnp.arange(B)[:, None]
        codes = self.codes.at[b_idx, :, slot].set(q.transpose(0, 2, 1, 3), mode="drop")
        g = jnp.arange(L // G, dtype=jnp.int32)[None, :]
        g_keep = ((g + 1) * G <= done) & ((g + 1) * G > total - Wp)
        g_slot = jnp.where(g_keep, jnp.mod(blk0 + g * G, Wp) // G, Wp // G)
        sd = self.scale.dtype
        new_scale = self.scale.at[b_idx, :, g_slot].set(scale.transpose(0, 2, 1, 3).astype(sd),
                                                        mode="drop")
        new_offset = self.offset.at[b_idx, :, g_slot].set(
            offset.transpose(0, 2, 1, 3).astype(sd), mode="drop")
        r_slot = jnp.where((p >= done) & (p < total), p - done, R)
        resid = self.resid.at[b_idx, :, r_slot].set(E.transpose(0, 2, 1, 3).astype(self.dtype),
                                                    mode="drop")
        return self.replace(codes=codes, scale=new_scale, offset=new_offset, resid=resid,
                            sinks=scatter(self.sinks, chunk),
                            head=jnp.mod(self.head + lay.n_nonsink, Wp))


@struct.dataclass
class KiviValues(_View):
    """codes [B, KVH, W', P], scale/offset [B, KVH, W', D/G] (per token and group of G
    channels), resid [B, KVH, R+1, D] (the most recent values, a ring with head ``rhead`` [B]),
    sinks [B, KVH, S, D], head [B] (the next offset)."""

    codes: Array
    scale: Array
    offset: Array
    resid: Array
    rhead: Array
    sinks: Array
    head: Array
    spec: KVQuant = struct.field(pytree_node=False)
    window: int = struct.field(pytree_node=False, default=0)

    def dequantized(self) -> Float[Array, "b n w h"]:
        q = unpack(self.codes, self.spec.bits, self.head_dim) if self.spec.packed else self.codes
        return dequantize(q, self.scale, self.offset, self.spec.per_token)

    def read(self, lay) -> Float[Array, "b n c h"]:
        R, W, Wp = self.spec.residual, self.window, self.codes.shape[2]
        x = _gather(self.dequantized(), token_offsets(lay, self.head, W, Wp))
        i = jnp.arange(W, dtype=jnp.int32)[None, :]
        d = jnp.mod(lay.old_head[:, None] - 1 - i, W) + 1  # tokens back from the chunk
        recent = d <= jnp.minimum(lay.ring_count[:, None], R)
        idx = jnp.mod(self.rhead[:, None] - d, R + 1)  # [B, W]
        full = _gather(self.resid, jnp.clip(idx, 0, R))
        ring = jnp.where(recent[:, None, :, None], full.astype(jnp.float32), x)
        return jnp.concatenate([self.sinks, ring.astype(self.dtype)], axis=2)

    def write(self, chunk, lay, scatter) -> "KiviValues":
        R, Wp = self.spec.residual, self.codes.shape[2]
        B, T = lay.nonsink_rank.shape
        n = lay.n_nonsink[:, None]
        r = lay.nonsink_rank  # [B, T], >= 0 for this chunk's non-sink tokens
        b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))

        def put(a, rows, keep, slot, size):
            slot = jnp.where(keep, slot, size)
            return a.at[b_idx, :, slot].set(rows.transpose(0, 2, 1, 3).astype(a.dtype),
                                            mode="drop")
        q, s, o = quantize(chunk, self.spec.per_token)
        if self.spec.packed:
            q = pack(q, self.spec.bits)
        at = jnp.mod(self.head[:, None] + r, Wp)
        last = (r >= 0) & (r >= n - Wp)  # the chunk's tokens the store keeps
        recent = (r >= 0) & (r >= n - (R + 1))  # ... and the last R + 1 of them in full
        return self.replace(
            codes=put(self.codes, q, last, at, Wp), scale=put(self.scale, s, last, at, Wp),
            offset=put(self.offset, o, last, at, Wp),
            resid=put(self.resid, chunk, recent, jnp.mod(self.rhead[:, None] + r, R + 1), R + 1),
            rhead=jnp.mod(self.rhead + lay.n_nonsink, R + 1), sinks=scatter(self.sinks, chunk),
            head=jnp.mod(self.head + lay.n_nonsink, Wp))


def empty_kivi(spec: KVQuant, batch: int, kv_heads: int, slots: int, sinks: int, head_dim: int,
               dtype, values: bool):
    spec.check(head_dim)
    W, R, G = slots - sinks, spec.residual, spec.group
    Wp = ring_size(W, R)
    sd = jnp.dtype(spec.scale_dtype)
    common = dict(codes=_codes(spec, batch, kv_heads, Wp, head_dim),
                  sinks=jnp.zeros((batch, kv_heads, sinks, head_dim), dtype),
                  head=jnp.zeros((batch,), jnp.int32), spec=spec, window=W)
    if values:
        side = (batch, kv_heads, Wp, head_dim // G)
        return KiviValues(scale=jnp.ones(side, sd), offset=jnp.zeros(side, sd),
                          resid=jnp.zeros((batch, kv_heads, R + 1, head_dim), dtype),
                          rhead=jnp.zeros((batch,), jnp.int32), **common)
    side = (batch, kv_heads, Wp // G, head_dim)
    return KiviKeys(scale=jnp.ones(side, sd), offset=jnp.zeros(side, sd),
                    resid=jnp.zeros((batch, kv_heads, R, head_dim), dtype), **common)


def kivi_counts(cache) -> dict:
    """KIVI's buffer counts per row, from the counters (row 0; for the tests and the docs):
    keys quantized / in full precision, values quantized / in full precision, among the
    non-sink tokens in the cache."""
    import numpy as np
    R = cache.k[0].spec.residual
    n = int(np.asarray(cache.length)[0]) - cache.sinks  # non-sink tokens held
    k_full = min(int(np.asarray(cache.k[0].head)[0]) % R, n)
    return {"keys_quantized": n - k_full, "keys_full": k_full,
            "values_quantized": max(n - R, 0), "values_full": min(n, R)}
