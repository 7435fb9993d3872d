"""Quantized KV-cache storage: int8 and k-bit per-token codes in the fixed-shape cache (KIVI's
stores, which build on these quantizers, are jaxllm.kv.kivi).

Formats (``KVQuant.format``; docs/METHODS.md §5):

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

from ..errors import P, SettingError
from ..lowbit import pack, unpack  # the one packing: code j of word w is channel w·per + j

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
            raise SettingError(f"{P.kv_bits} {self.bits} is not supported by the {self.format} "
                               f"format; choose one of {', '.join(map(str, BITS[self.format]))}")
        if self.group < 0:
            raise SettingError(f"{P.kv_group} must be >= 0 (0: the whole head), got {self.group}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"kv scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got "
                             f"{self.scale_dtype!r}")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"kv zero_point must be float or clamped, got {self.zero_point!r}")
        if self.format == "kivi":
            if self.group < 1:
                raise SettingError(f"{P.kv_group} must be >= 1 for kivi (G tokens share a key "
                                   f"scale per channel), got {self.group}")
            if self.residual < self.group:
                raise SettingError(f"{P.kv_residual} {self.residual} must be >= the {P.kv_group} "
                                   f"{self.group} (R >= G)")
            if self.residual % self.group:
                raise SettingError(f"{P.kv_group} {self.group} must divide the {P.kv_residual} "
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
            raise SettingError(f"{P.kv_group} {G} must divide head_dim {head_dim}")
        if self.format in ("token", "kivi") and self.bits in PACKED and \
                head_dim % (32 // self.bits):
            raise SettingError(f"{P.kv_bits} {self.bits} packs {32 // self.bits} codes per "
                               f"uint32 word: head_dim {head_dim} must be a multiple of "
                               f"{32 // self.bits}")

    def describe(self) -> str:
        if not self.enabled:
            return "float"
        if self.format == "int8":
            return "int8 per token"
        if self.format == "kivi":
            return f"KIVI-{self.bits}, group {self.group}, residual {self.residual}"
        return f"{self.bits}-bit per token, group {self.group or 'head'}"

    @property
    def packed(self) -> bool:
        return self.format in ("token", "kivi") and self.bits in PACKED

    @property
    def per_token(self) -> "KVQuant":
        """The per-token quantizer of KIVI's values (groups of G channels)."""
        return dataclasses.replace(self, format="token")


# ---- the quantizers (pure functions over [..., D]) ------------------------------------------------

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
