"""Pure-jnp references of every kernel: the ground truth of the interpret-mode tests and the
``xla`` backend of the dispatcher (what runs on CPU)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8

from .common import NEG_INF

QMAX = 127.0


K_MULTIPLE = 16


def int8_einsum(eq: str, a: Int8[Array, "..."], b: Int8[Array, "..."]) -> Int[Array, "..."]:
    """``jnp.einsum(eq, a, b)`` of int8 operands with an exact int32 result.

    Every contracted axis is zero-padded to a multiple of 16 first (zeros add nothing to an
    integer sum). XLA on an H100 (jax 0.11.2) returned twice the true product for contractions
    of 7 or 33 and failed to compile some small int8 einsums ("No supported config found");
    with the contraction padded every shape checked was exact (benchmarks/xla_int8_check.py,
    docs/BENCHMARKS.md). Real models' contractions (hidden sizes, head dims) are already
    multiples of 16, so they pay nothing."""
    ins, out = eq.replace(" ", "").split("->")
    sa, sb = ins.split(",")
    contracted = (set(sa) & set(sb)) - set(out)

    def pad(x, sub):
        widths = [(0, -x.shape[i] % K_MULTIPLE if c in contracted else 0) for i, c in
                  enumerate(sub)]
        return jnp.pad(x, widths) if any(w for _, w in widths) else x

    return jnp.einsum(eq, pad(a, sa), pad(b, sb), preferred_element_type=jnp.int32)


def computed_once(x: Array) -> Array:
    """``x``, materialised as one array. XLA:CPU fuses elementwise producers into each consumer,
    where they are then evaluated per consumed element: cos and sin per gathered key element, a
    LayerNorm or a quantizer per weight
    element of a vector-matrix product. It drops optimization barriers before fusion, but never
    fuses a reduction into a consumer."""
    return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)


def after(x: Array, y: Float[Array, "..."]) -> Float[Array, "..."]:
    """``y``, computed once ``x`` is: ``y`` plus zero times ``x``'s first element, which fuses
    into the loop that makes ``y``. XLA schedules work that depends on weights alone wherever it
    likes, and at the start of a prefill it widened every layer's weight to float32 at once
    (docs/CPU.md, "Peak memory"); an optimization barrier does not order it on XLA:CPU, which
    drops barriers before scheduling. A NaN or infinity first in ``x`` makes ``y`` NaN (a forward
    with one has lost its numbers already)."""
    return y + (x.reshape(-1)[0] * 0).astype(y.dtype)


# float32 holds every integer up to 2^24 exactly, so a float32 sum of int8 products (each at most
# 128^2 = 2^14 in magnitude) is exact, in any order, for contractions up to 2^10.
EXACT_F32_K = 2 ** 24 // 128 ** 2


def int8_matmul(x: Int8[Array, "m k"], w: Int8[Array, "n k"]) -> Int[Array, "m n"]:
    """x @ wᵀ, int8 x int8 -> int32 exactly; ``w`` K-major [N, K] as the kernels store it."""
    M, K = x.shape
    if M == 1 and K <= EXACT_F32_K and jax.default_backend() == "cpu":
        # One row on CPU: XLA emits x @ w.T as a loop fusion that converts the int8 weight as it
        # reads it, faster than the padded int8 GEMM, and the float32 sums are exact
        # (EXACT_F32_K). The row is materialised first, or its quantizer
        # would be fused in and recomputed per output.
        xf = computed_once(x.astype(jnp.float32))
        return (xf @ w.astype(jnp.float32).T).astype(jnp.int32)
    if M == 1:  # XLA:CPU's int8 one-row product is far slower than a two-row one: pad a row
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    return int8_einsum("mk,nk->mn", x, w)[:M]


def epilogue(acc: Int[Array, "m n"], sx: Float[Array, " m"], sw: Float[Array, " n"],
             bias: Optional[Float[Array, " n"]], out_dtype) -> Array:
    """y = acc · s_x[m] · s_w[n] (+ bias): SmoothQuant eq. 2's dequantization, in float32."""
    y = acc.astype(jnp.float32) * sx[:, None] * sw[None, :]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


def w8a8_matmul(x, w, sx, sw, bias=None, out_dtype=jnp.float32):
    """The fused W8A8 linear: int8 product then the epilogue (``out_dtype=int32``: the raw
    accumulator)."""
    if jnp.dtype(out_dtype) == jnp.int32:
        return int8_matmul(x, w)
    return epilogue(int8_matmul(x, w), sx, sw, bias, out_dtype)


def normalize(x: Float[Array, "m d"], norm: Optional[str], gamma=None, beta=None,
              eps: float = 1e-5) -> Float[Array, "m d"]:
    """LayerNorm (gamma, beta) / RMSNorm (gamma) / identity, in float32."""
    x = x.astype(jnp.float32)
    if norm is None:
        return x
    if norm == "rmsnorm":
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * gamma
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    y = (x - mu) * jax.lax.rsqrt(var + eps) * gamma
    return y if beta is None else y + beta


def quantize_per_token(x: Float[Array, "m d"], norm: Optional[str] = None, gamma=None, beta=None,
                       eps: float = 1e-5) -> tuple[Int8[Array, "m d"], Float[Array, " m"]]:
    """(optionally normalised) rows to int8 with one absmax scale each: Δ = max|y| / 127
    (1 for an all-zero row), q = round-half-even(y / Δ) clipped to ±127."""
    y = normalize(x, norm, gamma, beta, eps)
    m = jnp.max(jnp.abs(y), -1)
    scale = jnp.where(m > 0, m / QMAX, 1.0)
    q = jnp.clip(jnp.round(y / scale[:, None]), -QMAX, QMAX).astype(jnp.int8)
    return q, scale


def int8_bmm(a: Int8[Array, "b m k"], b: Int8[Array, "b n k"], sa: Float[Array, "b m"],
             sb: Float[Array, "b n"], out_dtype=jnp.float32) -> Array:
    """Batched W8A8 product (attention's QKᵀ and PV) with scales on the outer dims."""
    acc = int8_einsum("bmk,bnk->bmn", a, b)
    return (acc.astype(jnp.float32) * sa[..., :, None] * sb[..., None, :]).astype(out_dtype)


# ---- decode attention over stored slots (pallas_kernels.decode) ----------------------------------
from .decode import permute, unpermute  # noqa: E402  (decode imports nothing from here)
# Whole arrays dequantized, each key turned by its own angle: the kernel reads the same formats
# a block at a time and turns keys by angle addition.
def stored_slots(arrays: tuple, lay, D: int) -> Float[Array, "n l d"]:
    """A side's slots as float32 [N, L, D] in the natural channel order (the reference's
    reading, array by array, of what the kernel reads a block at a time)."""
    x = arrays[0]
    if lay.packed:
        shifts = (lay.bits * jnp.arange(lay.per, dtype=jnp.uint32))[:, None]  # [per, 1]
        f = (x[..., None, :] >> shifts) & jnp.uint32((1 << lay.bits) - 1)  # [N, L, per, P]
        x = unpermute(f.reshape(*x.shape[:2], D), lay.per)
    x = x.astype(jnp.float32)
    if lay.kind == "float":
        return x
    if lay.kind == "int8":
        return x * arrays[1].astype(jnp.float32)
    if lay.kind == "token":
        Gc = lay.channel_group(D)
        rep = lambda a: jnp.repeat(a.astype(jnp.float32), Gc, axis=-1)  # noqa: E731
        return x * rep(arrays[1]) + rep(arrays[2])
    rep = lambda a: unpermute(jnp.repeat(a.astype(jnp.float32), lay.group, axis=1),  # noqa
                              lay.per)
    return x * rep(arrays[1]) + rep(arrays[2])


def decode_partials(q, keys, values, pick, dist=None, slopes=None, rope=None, *, k_layout,
                    v_layout):
    """pallas_kernels.decode.partials over all the slots as one split, in jnp: the sides dequantized whole,
    the keys rotated by each slot's own angle (not by angle addition), one softmax ->
    (m, l [N, G], acc [N, G, D]), acc permuted as the kernel's."""
    N, Rq, G, D = q.shape
    B, L = pick.shape
    KVH, per = N // B, k_layout.per
    k, v = stored_slots(keys, k_layout, D), stored_slots(values, v_layout, D)
    if rope is not None:
        ang = (rope.first + jnp.arange(L, dtype=jnp.int32)).astype(jnp.float32)[None, :, None] \
            * rope.freq.astype(jnp.float32)[:, None, :]  # [B, L, D/2]
        cos, sin = (jnp.repeat(rope.scale * t, KVH, axis=0) for t in (jnp.cos(ang), jnp.sin(ang)))
        a, b = k[..., :D // 2], k[..., D // 2:]
        k = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    by_row = lambda a: jnp.repeat(a, KVH, axis=0)  # noqa: E731  [B, ...] -> [N, ...]
    s = jnp.einsum("nrgd,nld->nrgl", unpermute(q.astype(jnp.float32), per), k)
    p = by_row(pick)[:, None, None, :]  # [N, 1, 1, L]
    s = jnp.take_along_axis(s, jnp.clip(p, 0, Rq - 1), axis=1)[:, 0]  # [N, G, L]
    if dist is not None:
        s = s - slopes.astype(jnp.float32)[..., None] * by_row(dist)[:, None, :].astype(
            jnp.float32)
    ok = p[:, 0] >= 0
    s = jnp.where(ok, s, NEG_INF)
    m = jnp.max(s, -1)
    e = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    return m, e.sum(-1), permute(jnp.einsum("ngl,nld->ngd", e, v), per)
