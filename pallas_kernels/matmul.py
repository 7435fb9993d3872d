"""Pallas INT8 kernels: the W8A8 matmul with a fused dequantization epilogue, the batched
version for attention, and per-token quantization fused with the preceding norm.

Two lowerings of the same algorithm (docs/METHODS.md §8):

* ``triton`` (GPU): a 2-D grid over (M, N) blocks; each program walks K in ``bk`` steps with
  int8 x int8 -> int32 ``dot`` (accumulated as ``acc + dot``: the ``dot(a, b, acc)`` form broke
  for large int8 blocks), then applies the epilogue in registers. Power-of-two blocks; M is padded
  to at least 16 rows.
* ``tpu`` (Mosaic TPU): a 3-D grid (M, N, K) with K last and "arbitrary", an int32 VMEM scratch
  accumulator, the epilogue on the last K step. Int8 blocks are multiples of (32, 128).

Weights are K-major [N, K] (what Hopper's int8 wgmma and our ``QKernel`` store). Every dimension
is zero-padded to its block multiple (zeros add nothing to an integer dot; padded rows/columns are
sliced off), so any M, K, N works. Both kernels also run on CPU in interpret mode: ``triton`` with
Pallas' generic interpreter, ``tpu`` with the TPU interpreter (``pltpu.InterpretParams``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import reference as ref

QMAX = ref.QMAX


@dataclasses.dataclass(frozen=True)
class Blocks:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4  # triton
    num_stages: int = 3  # triton


def default_blocks(backend: str, M: int) -> Blocks:
    """Block sizes per backend and M regime. GPU: decode (M <= 16) streams the weight, so wide
    N blocks and long K steps; prefill uses 128x128 tiles (Hopper int8 needs bm % 64 == 0 and
    bk >= 32, docs/METHODS.md §8). TPU: MXU-sized tiles, int8 sublane multiple 32."""
    if backend == "triton":
        if M <= 16:
            return Blocks(16, 64, 256, num_warps=4, num_stages=4)
        if M <= 128:
            return Blocks(64, 128, 128, num_warps=4, num_stages=4)
        return Blocks(128, 128, 128, num_warps=8, num_stages=3)
    if backend == "tpu":
        return Blocks(min(256, _round_up(M, 32)), 256, 512)
    raise ValueError(f"no Pallas blocks for backend {backend!r}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad2(a, rows: int, cols: int):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _check(cond: bool, msg: str) -> None:
    """Shape and dtype errors at trace time, named, instead of a lowering failure later."""
    if not cond:
        raise ValueError(msg)


def _matmul_cost(B: int, M: int, N: int, K: int, out_dtype) -> pl.CostEstimate:
    """What one call does, for XLA's scheduler (an opaque custom call otherwise looks free):
    the int8 multiply-adds and the bytes of both operands, the scales and the output."""
    out = jnp.dtype(out_dtype).itemsize
    return pl.CostEstimate(flops=2 * B * M * N * K, transcendentals=0,
                           bytes_accessed=B * (M * K + N * K + 4 * (M + 2 * N) + out * M * N))


def _dot_nt(a, b):
    """a [m, k] · b [n, k]ᵀ -> int32 [m, n]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


# ---- W8A8 matmul ------------------------------------------------------------------------------
def _triton_kernel(x_ref, w_ref, sx_ref, sw_ref, b_ref, o_ref, *, nk: int, bk: int):
    bm, bn = o_ref.shape

    def body(k, acc):
        xs = x_ref[:, pl.ds(k * bk, bk)]  # [bm, bk] int8
        ws = w_ref[:, pl.ds(k * bk, bk)]  # [bn, bk] int8
        return acc + _dot_nt(xs, ws)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.int32))
    if o_ref.dtype == jnp.int32:  # the raw accumulator (no epilogue)
        o_ref[...] = acc
        return
    y = acc.astype(jnp.float32) * sx_ref[...][:, None] * sw_ref[...][None, :] + b_ref[...][None, :]
    o_ref[...] = y.astype(o_ref.dtype)


def _tpu_kernel(x_ref, w_ref, sx_ref, sw_ref, b_ref, o_ref, acc_ref, *, nk: int):
    k = pl.program_id(3)  # grid (batch, M, N, K)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += _dot_nt(x_ref[...], w_ref[...])

    @pl.when(k == nk - 1)
    def _():
        if o_ref.dtype == jnp.int32:  # the raw accumulator (no epilogue)
            o_ref[...] = acc_ref[...]
            return
        y = acc_ref[...].astype(jnp.float32) * sx_ref[...] * sw_ref[...] + b_ref[...]
        o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "backend", "blocks", "interpret"))
def w8a8_matmul(x, w, sx, sw, bias=None, out_dtype=jnp.float32, *, backend: str,
                blocks: Optional[Blocks] = None, interpret: bool = False):
    """y [M, N] = (x [M, K] int8 · w [N, K]ᵀ int8 as int32) · sx[m] · sw[n] + bias[n].

    ``sx``: [M] (per token) or [] (per tensor); ``sw``: [N] (per channel) or [].
    ``out_dtype=int32`` returns the raw int32 accumulator (scales and bias unused). ``backend``:
    ``triton`` or ``tpu`` (see the module docstring); ``interpret`` runs it on CPU."""
    _check(x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1],
           f"w8a8_matmul needs x [M, K] and w [N, K] (K-major) with the same K; got "
           f"{x.shape} and {w.shape}")
    M, N = x.shape[0], w.shape[0]
    _check(jnp.ndim(sx) == 0 or jnp.shape(sx) == (M,), f"sx must be [] or [M]=({M},), got "
           f"{jnp.shape(sx)}")
    _check(jnp.ndim(sw) == 0 or jnp.shape(sw) == (N,), f"sw must be [] or [N]=({N},), got "
           f"{jnp.shape(sw)}")
    _check(bias is None or bias.shape == (N,), f"bias must be [N]=({N},), got "
           f"{None if bias is None else bias.shape}")
    sx = jnp.broadcast_to(jnp.asarray(sx, jnp.float32), (M,))
    sw = jnp.broadcast_to(jnp.asarray(sw, jnp.float32), (N,))
    bias = jnp.zeros((N,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    return _batched(x[None], w[None], sx[None], sw[None], bias[None], out_dtype, backend,
                    blocks, interpret)[0]


def int8_bmm(a, b, sa, sb, out_dtype=jnp.float32, *, backend: str, interpret: bool = False,
             blocks: Optional[Blocks] = None):
    """Batched W8A8 product a [B, M, K] · b [B, N, K]ᵀ -> [B, M, N] with scales sa [B, M] and
    sb [B, N] (attention's QKᵀ and PV): the matmul kernel with a leading batch grid axis."""
    _check(a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[2],
           f"int8_bmm needs a [B, M, K] and b [B, N, K] with the same B and K; got {a.shape} "
           f"and {b.shape}")
    _check(sa.shape == a.shape[:2] and sb.shape == b.shape[:2],
           f"scales must be sa [B, M]={a.shape[:2]} and sb [B, N]={b.shape[:2]}; got "
           f"{sa.shape} and {sb.shape}")
    zero = jnp.zeros(sb.shape, jnp.float32)
    return _batched_jit(a, b, sa.astype(jnp.float32), sb.astype(jnp.float32), zero, out_dtype,
                        backend, blocks, interpret)


def _batched(x, w, sx, sw, bias, out_dtype, backend, blocks, interpret):
    """x [B, M, K], w [B, N, K], sx [B, M], sw / bias [B, N] -> [B, M, N]."""
    B, M, K = x.shape
    N = w.shape[1]
    _check(x.dtype == jnp.int8 and w.dtype == jnp.int8, f"the INT8 kernels take int8 operands, "
           f"got {x.dtype} and {w.dtype} (quantize first: pallas_kernels.quantize_per_token)")
    b = blocks or default_blocks(backend, M)
    cost = _matmul_cost(B, M, N, K, out_dtype)
    Mp, Np, Kp = _round_up(M, b.bm), _round_up(N, b.bn), _round_up(K, b.bk)
    pad = lambda a, *sizes: jnp.pad(a, [(0, 0)] + [(0, t - n) for t, n in zip(sizes, a.shape[1:])])  # noqa: E731
    xp, wp = pad(x, Mp, Kp), pad(w, Np, Kp)
    sxp, swp, bp = pad(sx, Mp), pad(sw, Np), pad(bias, Np)
    nk = Kp // b.bk
    out_shape = jax.ShapeDtypeStruct((B, Mp, Np), out_dtype)
    if backend == "triton":
        from jax.experimental.pallas import triton as pl_triton
        y = pl.pallas_call(
            functools.partial(_triton_kernel, nk=nk, bk=b.bk),
            grid=(B, Mp // b.bm, Np // b.bn),
            in_specs=[pl.BlockSpec((None, b.bm, Kp), lambda z, i, j: (z, i, 0)),
                      pl.BlockSpec((None, b.bn, Kp), lambda z, i, j: (z, j, 0)),
                      pl.BlockSpec((None, b.bm), lambda z, i, j: (z, i)),
                      pl.BlockSpec((None, b.bn), lambda z, i, j: (z, j)),
                      pl.BlockSpec((None, b.bn), lambda z, i, j: (z, j))],
            out_specs=pl.BlockSpec((None, b.bm, b.bn), lambda z, i, j: (z, i, j)),
            out_shape=out_shape, interpret=interpret, cost_estimate=cost,
            compiler_params=pl_triton.CompilerParams(num_warps=b.num_warps,
                                                     num_stages=b.num_stages),
        )(xp, wp, sxp, swp, bp)
    elif backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        y = pl.pallas_call(
            functools.partial(_tpu_kernel, nk=nk),
            grid=(B, Mp // b.bm, Np // b.bn, nk),
            in_specs=[pl.BlockSpec((None, b.bm, b.bk), lambda z, i, j, k: (z, i, k)),
                      pl.BlockSpec((None, b.bn, b.bk), lambda z, i, j, k: (z, j, k)),
                      pl.BlockSpec((None, b.bm, 1), lambda z, i, j, k: (z, i, 0)),
                      pl.BlockSpec((None, 1, b.bn), lambda z, i, j, k: (z, 0, j)),
                      pl.BlockSpec((None, 1, b.bn), lambda z, i, j, k: (z, 0, j))],
            out_specs=pl.BlockSpec((None, b.bm, b.bn), lambda z, i, j, k: (z, i, j)),
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((b.bm, b.bn), jnp.int32)], cost_estimate=cost,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=pltpu.InterpretParams() if interpret else False,
        )(xp, wp, sxp[..., None], swp[:, None], bp[:, None])
    else:
        raise ValueError(f"unknown Pallas backend {backend!r}; use triton or tpu")
    return y[:, :M, :N]


_batched_jit = jax.jit(_batched, static_argnums=(5, 6, 7, 8))


# ---- per-token quantization fused with the norm -----------------------------------------------
def _round_half_even(v):
    """``jnp.round`` (ties to even) built from ``floor``: the Triton lowering has no ``round``
    primitive. Exact for |v| < 2^23 (``v - floor(v)`` is then exact)."""
    f = jnp.floor(v)
    d = v - f
    odd = f - 2.0 * jnp.floor(f * 0.5) != 0
    return jnp.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


def _quant_kernel(x_ref, g_ref, b_ref, q_ref, s_ref, *, norm: Optional[str], eps: float, d: int):
    x = x_ref[...].astype(jnp.float32)  # [bm, Dp]; columns >= d are padding
    valid = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < d
    if norm == "layernorm":
        mu = jnp.sum(x, -1, keepdims=True) / d  # padding is zero: sums are exact over d
        xc = jnp.where(valid, x - mu, 0.0)
        var = jnp.sum(xc * xc, -1, keepdims=True) / d
        y = xc * jax.lax.rsqrt(var + eps) * g_ref[...] + b_ref[...]
    elif norm == "rmsnorm":
        y = x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) / d + eps) * g_ref[...]
    else:
        y = x
    y = jnp.where(valid, y, 0.0)
    m = jnp.max(jnp.abs(y), -1, keepdims=True)
    scale = jnp.where(m > 0, m / QMAX, 1.0)  # [bm, 1]
    q_ref[...] = jnp.clip(_round_half_even(y / scale), -QMAX, QMAX).astype(jnp.int8)
    s_ref[...] = scale


@functools.partial(jax.jit, static_argnames=("norm", "eps", "backend", "block_rows",
                                             "interpret"))
def quantize_per_token(x, gamma=None, beta=None, *, norm: Optional[str] = None,
                       eps: float = 1e-5, backend: str, block_rows: int = 0,
                       interpret: bool = False):
    """Rows of x [M, D] (optionally LayerNorm/RMSNorm-ed first) to int8 + one scale per row,
    in one pass over x. Returns (q [M, D] int8, scale [M] float32)."""
    if norm not in (None, "layernorm", "rmsnorm"):
        raise ValueError(f"unknown norm {norm!r}; use layernorm, rmsnorm or None")
    _check(x.ndim == 2, f"quantize_per_token takes rows x [M, D], got shape {x.shape}")
    M, D = x.shape
    for name, v in (("gamma", gamma), ("beta", beta)):
        _check(v is None or v.shape == (D,), f"{name} must be [D]=({D},), got "
               f"{None if v is None else v.shape}")
    bm = block_rows or (32 if backend == "tpu" else 16)
    Dp = _round_up(D, 128)  # lane-dense rows on TPU; a power-of-two-friendly width on GPU
    if backend == "triton":
        Dp = max(Dp, 1 << (D - 1).bit_length())  # Triton blocks are powers of two
    Mp = _round_up(M, bm)
    xp = _pad2(x, Mp, Dp)
    g = jnp.pad(jnp.ones((D,), jnp.float32) if gamma is None else gamma.astype(jnp.float32),
                (0, Dp - D))[None]
    bt = jnp.pad(jnp.zeros((D,), jnp.float32) if beta is None else beta.astype(jnp.float32),
                 (0, Dp - D))[None]
    kernel = functools.partial(_quant_kernel, norm=norm, eps=eps, d=D)
    kw = {}
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        kw["interpret"] = pltpu.InterpretParams() if interpret else False
    elif backend == "triton":
        kw["interpret"] = interpret
    else:
        raise ValueError(f"unknown Pallas backend {backend!r}; use triton or tpu")
    q, s = pl.pallas_call(
        kernel, grid=(Mp // bm,),
        in_specs=[pl.BlockSpec((bm, Dp), lambda i: (i, 0)),
                  pl.BlockSpec((1, Dp), lambda i: (0, 0)),
                  pl.BlockSpec((1, Dp), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((bm, Dp), lambda i: (i, 0)),
                   pl.BlockSpec((bm, 1), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((Mp, Dp), jnp.int8),
                   jax.ShapeDtypeStruct((Mp, 1), jnp.float32)],
        # a read of x, a write of q and scale; the norm is a few flops per element, one rsqrt
        # per row
        cost_estimate=pl.CostEstimate(flops=8 * M * D, transcendentals=M,
                                      bytes_accessed=M * D * (x.dtype.itemsize + 1) + 4 * M),
        **kw,
    )(xp, g, bt)
    return q[:M, :D], s[:M, 0]
