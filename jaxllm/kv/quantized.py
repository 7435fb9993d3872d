"""Quantized KV-cache storage: int8 and k-bit per-token codes in the fixed-shape cache.

Formats (``KVQuant.format``; METHODS.md §Q-Hitter quantizer, §KIVI):

* ``none``: float keys and values (the cache's ``dtype``).
* ``int8``: per token and head, symmetric: Δ = max|x| / 127, codes = round(x / Δ) in int8.
* ``token``: per token, asymmetric, in groups of ``group`` channels (``group = head_dim`` is
  Q-Hitter's quantizer): scale = (max - min) / (2^b - 1), codes = round(clip((x - min) / scale,
  0, 2^b - 1)), x̂ = codes · scale + min. The minimum is stored as a float (KIVI's choice): the
  Q-Hitter authors' integer zero-point, clamped to [0, 2^b - 1], clips every group that does not
  straddle 0 ([2, 3, 4, 5] -> [2, 3, 3, 3] at 2 bits); ``zero_point="clamped"`` reproduces their
  rule for their numbers. A constant group (max = min) gets scale 0 and is stored exactly (KIVI's
  code divides by zero there).

Bits 2, 3, 4 or 8 (int8: 8). 2- and 4-bit codes are packed into uint32 words along the channels,
least significant bits first (code j of a word in bits [b·j, b·j + b)); 3- and 8-bit codes are
kept one per uint8 (3 bits do not divide a word; honest bytes over a clever layout). Scales and
minima are float16 by default: 10 mantissa bits against bfloat16's 7, for the same 2 bytes, and
keys and values stay far inside float16's range (KIVI stores them in float16 too); ``bfloat16``
is offered for models whose activations could exceed 65,504.

The sink slots (the first ``sinks`` tokens of a stream) always stay in full precision: they are
few and every query reads them. Every token is quantized once, when it is written, and never
re-quantized; so a chunk and the token-by-token process store the same codes, and attention, which
reads the cache after dequantizing it, sees the same keys and values either way (a chunk's own
tokens are quantized and dequantized before it attends to them, exactly as if written first).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float

FORMATS = ("none", "int8", "token", "kivi")
BITS = {"none": (16, 32), "int8": (8,), "token": (2, 3, 4, 8), "kivi": (2, 4, 8)}
PACKED = (2, 4)  # bit widths packed into uint32 words
SCALE_DTYPES = ("float16", "bfloat16")
ZERO_POINTS = ("float", "clamped")


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How the cache stores keys and values (static under jit). ``group``: channels per scale
    (``token``; 0 means the whole head, as Q-Hitter); ``scale_dtype``: of scales and minima;
    ``zero_point``: ``float`` (the minimum, exact for every group) or ``clamped`` (the Q-Hitter
    authors' integer zero-point, for reproducing their numbers)."""

    format: str = "none"
    bits: int = 8
    group: int = 0
    scale_dtype: str = "float16"
    zero_point: str = "float"
    residual: int = 32  # kivi: the most recent tokens kept in full precision (R)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"kv_quant format {self.format!r} is unknown; choose one of "
                             f"{', '.join(FORMATS)}")
        if self.format != "none" and self.bits not in BITS[self.format]:
            raise ValueError(f"kv bits {self.bits} is not supported by the {self.format} format; "
                             f"choose one of {', '.join(map(str, BITS[self.format]))}")
        if self.group < 0:
            raise ValueError(f"kv group must be >= 0 (0: the whole head), got {self.group}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"kv scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got "
                             f"{self.scale_dtype!r}")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"kv zero_point must be float or clamped, got {self.zero_point!r}")
        if self.format == "kivi":
            if self.group < 1:
                raise ValueError(f"kv group must be >= 1 for kivi (G tokens share a key scale "
                                 f"per channel), got {self.group}")
            if self.residual < self.group:
                raise ValueError(f"kv residual {self.residual} must be >= the kv group "
                                 f"{self.group} (R >= G)")
            if self.residual % self.group:
                raise ValueError(f"kv group {self.group} must divide the kv residual "
                                 f"{self.residual} (KIVI flushes R keys as R/G groups)")

    @property
    def enabled(self) -> bool:
        return self.format != "none"

    def group_of(self, head_dim: int) -> int:
        return self.group or head_dim

    def check(self, head_dim: int) -> None:
        """Errors that need the model's head_dim, named by parameter."""
        if not self.enabled:
            return
        G = self.group_of(head_dim)
        if self.format in ("token", "kivi") and head_dim % G:
            raise ValueError(f"kv group {G} must divide head_dim {head_dim}")
        if self.format in ("token", "kivi") and self.bits in PACKED and \
                head_dim % (32 // self.bits):
            raise ValueError(f"kv bits {self.bits} packs {32 // self.bits} codes per uint32 "
                             f"word: head_dim {head_dim} must be a multiple of {32 // self.bits}")

    def describe(self) -> str:
        if not self.enabled:
            return "float"
        if self.format == "int8":
            return "int8 per token"
        if self.format == "kivi":
            return f"KIVI-{self.bits}, group {self.group}, residual {self.residual}"
        return f"{self.bits}-bit per token, group {self.group or 'head'}"

    def check_window(self, window: int) -> None:
        if self.format == "kivi" and window % self.residual:
            raise ValueError(f"kv residual {self.residual} must divide the window {window} "
                             f"(cache - sinks): KIVI's key blocks of R tokens then fill whole "
                             f"ring slots")

    @property
    def packed(self) -> bool:
        return self.format in ("token", "kivi") and self.bits in PACKED

    @property
    def per_token(self) -> "KVQuant":
        """The per-token quantizer of KIVI's values (groups of G channels)."""
        return dataclasses.replace(self, format="token")


# ---- the quantizers (pure functions over [..., D]) ------------------------------------------------

def pack(codes, bits: int):
    """uint8 codes [..., D] -> uint32 [..., D·bits/32], code j of a word in bits [bits·j, ...)."""
    per = 32 // bits
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).astype(jnp.uint32)
    shifts = (bits * jnp.arange(per, dtype=jnp.uint32))
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32)  # fields do not overlap: sum = or


def unpack(words, bits: int, n: int):
    """Inverse of :func:`pack`: uint32 [..., n·bits/32] -> uint8 codes [..., n]."""
    per = 32 // bits
    shifts = (bits * jnp.arange(per, dtype=jnp.uint32))
    c = (words[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], n).astype(jnp.uint8)


def round_to(x: Float[Array, "..."], dtype) -> Float[Array, "..."]:
    """``x`` rounded to the 2-byte float ``dtype`` (float16, bfloat16), kept float32: a rounding
    every compiler keeps. ``x.astype(dtype).astype(float32)`` is not one: XLA:GPU removes such a
    convert pair inside a program (``--xla_allow_excess_precision``, on by default; openxla/xla
    issue 41605), so on a GPU a chunk quantized with the unrounded scale attended to other
    numbers than the cache then returned. ``lax.reduce_precision`` is kept; it flushes the
    format's subnormals to zero (|x| < 6.1e-5 in float16), so store ``round_to(x,
    dtype).astype(dtype)`` and the stored and the computed value are the same number."""
    fi = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=fi.nexp,
                                    mantissa_bits=fi.nmant)


def quantize(x: Float[Array, "... d"], spec: KVQuant):
    """``(codes [..., D] uint8/int8, scale [..., D/G], offset [..., D/G] or None)``. Codes are
    computed from the scale and minimum as stored (rounded to ``spec.scale_dtype``, round_to),
    so they are the best for what is kept, on every backend. A scale is at least the scale
    dtype's smallest normal (round_to would flush a smaller one to 0 and zero its row)."""
    D = x.shape[-1]
    sd = jnp.dtype(spec.scale_dtype)
    tiny = float(jnp.finfo(sd).smallest_normal)
    xf = x.astype(jnp.float32)
    if spec.format == "int8":
        m = jnp.max(jnp.abs(xf), -1, keepdims=True)
        scale = round_to(jnp.where(m > 0, jnp.maximum(m / 127.0, tiny), 1.0), sd)
        q = jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8)
        return q, scale.astype(sd), None
    G = spec.group_of(D)
    levels = float(2 ** spec.bits - 1)
    xg = xf.reshape(*x.shape[:-1], D // G, G)
    mn, mx = xg.min(-1), xg.max(-1)
    if spec.zero_point == "clamped":  # the Q-Hitter authors' Quantization_simulated
        s32 = jnp.maximum(mx - mn, 1e-5) / levels
        zero = jnp.clip(-jnp.round(mn / s32), 0, levels)
        q = jnp.clip(jnp.round(xg / s32[..., None]) + zero[..., None], 0, levels)
        return q.reshape(x.shape).astype(jnp.uint8), s32.astype(sd), zero.astype(sd)
    span = mx - mn
    s = round_to(jnp.where(span > 0, jnp.maximum(span / levels, tiny), 0.0), sd)
    o = round_to(mn, sd)
    scale, offset = s.astype(sd), o.astype(sd)
    s, o = s[..., None], o[..., None]
    q = jnp.where(s > 0, jnp.round(jnp.clip((xg - o) / jnp.where(s > 0, s, 1.0), 0, levels)), 0)
    return q.reshape(x.shape).astype(jnp.uint8), scale, offset


def dequantize(q, scale, offset, spec: KVQuant, dtype=jnp.float32):
    """x̂ [..., D] from :func:`quantize`'s output."""
    if spec.format == "int8":
        return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
    D = q.shape[-1]
    G = spec.group_of(D)
    qg = q.reshape(*q.shape[:-1], D // G, G).astype(jnp.float32)
    s, o = scale.astype(jnp.float32)[..., None], offset.astype(jnp.float32)[..., None]
    y = (qg - o) * s if spec.zero_point == "clamped" else qg * s + o
    return y.reshape(q.shape).astype(dtype)


def roundtrip(x, spec: KVQuant, dtype=None):
    """What the cache returns for ``x`` once stored."""
    return dequantize(*quantize(x, spec), spec, dtype or x.dtype)


# ---- the per-layer store --------------------------------------------------------------------------

class _Slots:
    """What attention sees of a store: [B, KVH, S+W, D] in the sinks' float dtype."""

    @property
    def head_dim(self) -> int:
        return self.sinks.shape[3]

    @property
    def shape(self) -> tuple:
        return self.codes.shape[:3] + (self.head_dim,)

    @property
    def dtype(self):
        return self.sinks.dtype


@struct.dataclass
class QStore(_Slots):
    """One layer's quantized keys (or values), [B, KVH, S+W, D] as seen by attention.

    ``codes``: [B, KVH, S+W, P] (P = D·b/32 uint32 words for 2/4 bits, D bytes otherwise);
    ``scale``/``offset``: [B, KVH, S+W, D/G]; ``sinks``: [B, KVH, S, D] in full precision (the
    codes of the sink slots are written too but never read)."""

    codes: Array
    scale: Array
    offset: Optional[Array]
    sinks: Array
    spec: KVQuant = struct.field(pytree_node=False)

    def _encode(self, x):
        q, s, o = quantize(x, self.spec)
        if self.spec.packed:
            q = pack(q, self.spec.bits)
        return q, s, o

    reads_before_write = False  # a decode step may write its token first, then read

    def read(self, lay=None) -> Float[Array, "b n c h"]:
        """Every slot dequantized, the sink slots in full precision."""
        q = self.codes
        if self.spec.packed:
            q = unpack(q, self.spec.bits, self.head_dim)
        x = dequantize(q, self.scale, self.offset, self.spec, self.dtype)
        S = self.sinks.shape[2]
        return jnp.concatenate([self.sinks, x[:, :, S:]], axis=2) if S else x

    def slots(self):
        """(pallas_kernels.decode.Layout, arrays [B·KVH, S+W, ...]) as the decode kernel reads
        them; None for the clamped zero-point (its own dequantization formula)."""
        from pallas_kernels.decode import Layout
        if self.spec.zero_point != "float":
            return None
        flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
        if self.spec.format == "int8":
            return Layout("int8", 8), (flat(self.codes), flat(self.scale))
        return (Layout("token", self.spec.bits, self.spec.group),
                (flat(self.codes), flat(self.scale), flat(self.offset)))

    def stored(self, chunk: Float[Array, "b n t h"]) -> Float[Array, "b n t h"]:
        """What the ring returns for ``chunk`` once written (quantized and dequantized)."""
        return roundtrip(chunk.astype(jnp.float32), self.spec, self.dtype)

    def write(self, chunk: Float[Array, "b n t h"], lay, scatter) -> "QStore":
        """After writing ``chunk``: ``scatter(array, rows)`` puts each chunk token's row at its
        cache slot (cache.write_chunk); the sink array takes the sink slots only (the others
        are out of its range, so dropped)."""
        q, s, o = self._encode(chunk)
        return self.replace(codes=scatter(self.codes, q), scale=scatter(self.scale, s),
                            offset=None if o is None else scatter(self.offset, o),
                            sinks=scatter(self.sinks, chunk))

    def select(self, chunk: Float[Array, "b n t h"], idx) -> "QStore":
        """Slot i takes entry ``idx[..., i]`` of [these slots | ``chunk``'s tokens] (score-based
        eviction's compression); the chunk's tokens are quantized as if written. A sink slot
        keeps the full-precision copy of whichever token lands there."""
        C1, S = self.codes.shape[2], self.sinks.shape[2]
        take = lambda a, new: jnp.take_along_axis(  # noqa: E731
            jnp.concatenate([a, new.astype(a.dtype)], 2), idx[..., None], axis=2)
        q, s, o = self._encode(chunk)
        sink_idx = jnp.where(idx[..., :S] < C1, idx[..., :S], idx[..., :S] - C1 + S)
        sinks = jnp.take_along_axis(jnp.concatenate([self.sinks, chunk.astype(self.dtype)], 2),
                                    sink_idx[..., None], axis=2)
        return self.replace(codes=take(self.codes, q), scale=take(self.scale, s),
                            offset=None if o is None else take(self.offset, o), sinks=sinks)


def _codes(spec: KVQuant, batch, kv_heads, slots, head_dim):
    width = head_dim * spec.bits // 32 if spec.packed else head_dim
    code_dtype = jnp.uint32 if spec.packed else (jnp.int8 if spec.format == "int8" else jnp.uint8)
    return jnp.zeros((batch, kv_heads, slots, width), code_dtype)


def empty_store(spec: KVQuant, batch: int, kv_heads: int, slots: int, sinks: int,
                head_dim: int, dtype) -> QStore:
    spec.check(head_dim)
    G = spec.group_of(head_dim) if spec.format == "token" else head_dim
    side = (batch, kv_heads, slots, head_dim // G)
    sd = jnp.dtype(spec.scale_dtype)
    return QStore(codes=_codes(spec, batch, kv_heads, slots, head_dim), scale=jnp.ones(side, sd),
                  offset=None if spec.format == "int8" else jnp.zeros(side, sd),
                  sinks=jnp.zeros((batch, kv_heads, sinks, head_dim), dtype), spec=spec)


# ---- KIVI: per-channel keys, per-token values, a full-precision residual -------------------------
#
# In the ring (W slots after the S sinks, R | W, G | R) the non-sink token u sits at ring offset
# i = u mod W (the cache's head). Keys: tokens are grouped in blocks of R consecutive tokens,
# aligned to multiples of R (so a block fills ring offsets [jR, jR + R)); a block's keys stay in
# full precision, in `resid` at offset i mod R, until its last token arrives, and are then
# quantized per channel in groups of G tokens (KIVI's flush of R keys, R/G groups). Values: every
# token's value is quantized per token (groups of G channels) when written; the R most recent are
# also kept in full precision in a ring of R + 1 slots (`resid`, its own bounded head `rhead`), and
# attention reads those in full: KIVI's sliding window of exactly R.
#
# Timing, as the authors' code: a step attends to the cache as it was before the step plus the
# step's own tokens in full precision, and quantizes afterwards. So a decode step sees the R
# previous values and its own (R + 1) in full, and the keys of the current incomplete block; a
# prompt fed in one chunk attends in full precision throughout (their prefill is fp16
# flash-attention), and one fed in several chunks sees the earlier chunks as quantized: chunked
# prefill equals token-by-token only in what is stored, not in the prompt's own logits.
#
# Eviction: the ring's oldest tokens leave the quantized region one by one as new tokens take
# their slots. A key group whose first slots were taken keeps its scale and minimum for its
# remaining members (the newcomers are read from `resid` until their block completes, which then
# rewrites the whole group).

def _ring_offsets(W: int):
    return jnp.arange(W, dtype=jnp.int32)[None, :]  # [1, W]


@struct.dataclass
class KiviKeys(_Slots):
    """codes [B, KVH, S+W, P] (per slot, packed along channels), scale/offset [B, KVH, W/G, D]
    (per ring group of G slots and channel), resid [B, KVH, R, D], sinks [B, KVH, S, D]."""

    codes: Array
    scale: Array
    offset: Array
    resid: Array
    sinks: Array
    spec: KVQuant = struct.field(pytree_node=False)
    reads_before_write = True  # a step reads the pre-step state, then quantizes

    def _dequant_ring(self):
        S, D, G = self.sinks.shape[2], self.head_dim, self.spec.group
        q = self.codes[:, :, S:]
        if self.spec.packed:
            q = unpack(q, self.spec.bits, D)
        B, H, W, _ = q.shape
        qg = q.reshape(B, H, W // G, G, D).astype(jnp.float32)
        y = qg * self.scale.astype(jnp.float32)[:, :, :, None] + \
            self.offset.astype(jnp.float32)[:, :, :, None]
        return y.reshape(B, H, W, D)

    def read(self, lay) -> Float[Array, "b n c h"]:
        R = self.spec.residual
        deq = self._dequant_ring()
        W = deq.shape[2]
        head = lay.old_head[:, None]  # [B, 1]
        i = _ring_offsets(W)
        in_block = (i >= head - jnp.mod(head, R)) & (i < head)  # the incomplete block: full
        full = jnp.tile(self.resid.astype(jnp.float32), (1, 1, W // R, 1))  # offset i -> i mod R
        ring = jnp.where(in_block[:, None, :, None], full, deq).astype(self.dtype)
        return jnp.concatenate([self.sinks, ring], axis=2)

    def stored(self, chunk):
        return chunk.astype(self.dtype)  # a step attends to its own tokens in full precision

    def write(self, chunk, lay, scatter) -> "KiviKeys":
        R, G, D = self.spec.residual, self.spec.group, self.head_dim
        B, H, T, _ = chunk.shape
        S, W = self.sinks.shape[2], self.codes.shape[2] - self.sinks.shape[2]
        head, n = lay.old_head[:, None], lay.n_nonsink[:, None]  # [B, 1]
        k0 = jnp.mod(head, R)  # tokens of the incomplete block before the chunk
        blk0 = head - k0  # its ring offset
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
        scale, offset = scale[..., 0], offset[..., 0]  # [B, H, L/G, D]
        if self.spec.packed:
            q = pack(q, self.spec.bits)
        keep = (p < done) & (p >= total - W)  # quantized and still in the ring after the chunk
        slot = jnp.where(keep, S + jnp.mod(blk0 + p, W), S + W)  # S + W: dropped
        b_idx = jnp.arange(B)[:, None]
        codes = self.codes.at[b_idx, :, slot].set(q.transpose(0, 2, 1, 3), mode="drop")
        g = jnp.arange(L // G, dtype=jnp.int32)[None, :]
        g_keep = ((g + 1) * G <= done) & ((g + 1) * G > total - W)
        g_slot = jnp.where(g_keep, jnp.mod(blk0 + g * G, W) // G, W // G)
        sd = self.scale.dtype
        new_scale = self.scale.at[b_idx, :, g_slot].set(scale.transpose(0, 2, 1, 3).astype(sd),
                                                        mode="drop")
        new_offset = self.offset.at[b_idx, :, g_slot].set(
            offset.transpose(0, 2, 1, 3).astype(sd), mode="drop")
        r_slot = jnp.where((p >= done) & (p < total), p - done, R)
        resid = self.resid.at[b_idx, :, r_slot].set(E.transpose(0, 2, 1, 3).astype(self.dtype),
                                                    mode="drop")
        return self.replace(codes=codes, scale=new_scale, offset=new_offset, resid=resid,
                            sinks=scatter(self.sinks, chunk))


@struct.dataclass
class KiviValues:
    """codes [B, KVH, S+W, P], scale/offset [B, KVH, S+W, D/G] (per token), resid
    [B, KVH, R+1, D] (the most recent values, a ring with head ``rhead`` [B]), sinks."""

    store: QStore  # the per-token codes (KIVI's value quantizer is per token)
    resid: Array
    rhead: Array
    spec: KVQuant = struct.field(pytree_node=False)
    reads_before_write = True

    @property
    def shape(self) -> tuple:
        return self.store.shape

    @property
    def dtype(self):
        return self.store.dtype

    @property
    def head_dim(self) -> int:
        return self.store.head_dim

    def read(self, lay) -> Float[Array, "b n c h"]:
        R = self.spec.residual
        x = self.store.read()
        S = self.store.sinks.shape[2]
        W = x.shape[2] - S
        head = lay.old_head[:, None]
        d = jnp.mod(head - 1 - _ring_offsets(W), W) + 1  # tokens back from the chunk
        recent = d <= jnp.minimum(lay.ring_count[:, None], R)
        idx = jnp.mod(self.rhead[:, None] - d, R + 1)  # [B, W]
        full = jnp.take_along_axis(self.resid, jnp.clip(idx, 0, R)[:, None, :, None], axis=2)
        ring = jnp.where(recent[:, None, :, None], full.astype(x.dtype), x[:, :, S:])
        return jnp.concatenate([x[:, :, :S], ring], axis=2)

    def stored(self, chunk):
        return chunk.astype(self.dtype)

    def write(self, chunk, lay, scatter) -> "KiviValues":
        R = self.spec.residual
        B, T = lay.nonsink_rank.shape
        n = lay.n_nonsink[:, None]
        r = lay.nonsink_rank  # [B, T], >= 0 for this chunk's non-sink tokens
        keep = (r >= 0) & (r >= n - (R + 1))  # the last R + 1 of them
        slot = jnp.where(keep, jnp.mod(self.rhead[:, None] + r, R + 1), R + 1)
        b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        resid = self.resid.at[b_idx, :, slot].set(
            chunk.transpose(0, 2, 1, 3).astype(self.resid.dtype), mode="drop")
        return self.replace(store=self.store.write(chunk, lay, scatter), resid=resid,
                            rhead=jnp.mod(self.rhead + lay.n_nonsink, R + 1))


def empty_kivi(spec: KVQuant, batch: int, kv_heads: int, slots: int, sinks: int, head_dim: int,
               dtype, values: bool):
    spec.check(head_dim)
    W, R, G = slots - sinks, spec.residual, spec.group
    spec.check_window(W)
    sd = jnp.dtype(spec.scale_dtype)
    if values:
        return KiviValues(store=empty_store(spec.per_token, batch, kv_heads, slots, sinks,
                                            head_dim, dtype),
                          resid=jnp.zeros((batch, kv_heads, R + 1, head_dim), dtype),
                          rhead=jnp.zeros((batch,), jnp.int32), spec=spec)
    side = (batch, kv_heads, W // G, head_dim)
    return KiviKeys(codes=_codes(spec, batch, kv_heads, slots, head_dim), scale=jnp.ones(side, sd),
                    offset=jnp.zeros(side, sd),
                    resid=jnp.zeros((batch, kv_heads, R, head_dim), dtype),
                    sinks=jnp.zeros((batch, kv_heads, sinks, head_dim), dtype), spec=spec)


def kivi_counts(cache) -> dict:
    """KIVI's buffer counts per row, from the counters (row 0; for the tests and the docs):
    keys quantized / in full precision, values quantized / in full precision, among the
    non-sink tokens in the cache."""
    import numpy as np
    R = cache.k[0].spec.residual
    n = int(np.asarray(cache.length)[0]) - cache.sinks  # non-sink tokens held
    head = int(np.asarray(cache.head)[0])
    k_full = min(head % R, n) if n < cache.window else head % R
    return {"keys_quantized": n - k_full, "keys_full": k_full,
            "values_quantized": max(n - R, 0), "values_full": min(n, R)}
