"""Products of a few rows (a decode step's, M <= 64) against an int8 weight [N, K], split over K
as well as N so that a GPU's every SM streams part of the weight even at batch 1 (a grid over N
alone gives N/64 programs: 64 for Llama-2-7B's 4,096 outputs, under half an H100's 132 SMs).

Two modes of one kernel:

* ``w8a8`` (SmoothQuant O1): each row of x is quantized per token in the kernel, block by block,
  from its scale Δ = max|x| / 127 (computed beside the kernel: one small reduction), rounded
  half to even exactly as ``reference.quantize_per_token``; int8 x int8 -> int32 products.
  Each split's int32 sum is exact; the splits are summed in int32, then scaled (eq. 2).
* ``w8`` (weight-only): x in bfloat16 against the int8 weight converted in registers (an int8
  code is exact in bfloat16), float32 sums, the per-channel scale applied after the splits.

Grid (N / bn, splits); program (j, s) walks its K / splits columns in ``bk`` steps and writes
its partial [M, bn]. Blocks are chosen to divide the weight's N and K (Llama-2-7B's 4,096,
11,008 and 32,000; SmolLM2's 576 and 1,536), so the weight is read where it lies: no padded
copy per call. Rows are padded to 16 (the smallest Triton dot). A GPU kernel (Triton
lowering); TPU keeps pallas_kernels.matmul's Mosaic kernel. Interpret mode runs it on CPU;
``reference`` is the jnp form.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int8

from . import reference as ref
from .common import TARGET_PROGRAMS
from .matmul import _round_half_even

MODES = ("w8a8", "w8")
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    bn: int
    bk: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


def pow2_divisor(n: int, cap: int, floor: int = 16) -> int:
    """The largest power of two <= cap dividing n (at least ``floor``; 0 if none does)."""
    b = cap
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    return 0


def plan_for(M: int, N: int, K: int) -> Plan:
    """Blocks that divide N and K (128 x 256 at most; a weight no power of two >= 16 divides is
    padded instead), and splits of K that bring the programs to about TARGET_PROGRAMS (the last
    split may have fewer blocks: 11,008 = 43 x 256)."""
    bn = pow2_divisor(N, 128) or 64
    bk = pow2_divisor(K, 256) or 64
    nk = -(-K // bk)
    programs = -(-N // bn)
    return Plan(bn, bk, max(1, min(nk, -(-TARGET_PROGRAMS // programs))))


def _kernel(x_ref, s_ref, w_ref, o_ref, *, steps: int, nk: int, bk: int, mode: str):
    split = pl.program_id(1)
    base = split * steps * bk
    n = jnp.clip(nk - split * steps, 0, steps)  # this split's blocks (the last may have fewer)
    bm, bn = o_ref.shape
    if mode == "w8a8":
        scale = s_ref[...]  # [bm, 1]: each row's Δ

        def body(i, acc):
            cols = pl.ds(base + i * bk, bk)
            y = x_ref[:, cols].astype(jnp.float32) / scale
            xq = jnp.clip(_round_half_even(y), -ref.QMAX, ref.QMAX).astype(jnp.int8)
            return acc + jax.lax.dot_general(xq, w_ref[:, cols], (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.int32)
        o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros((bm, bn), jnp.int32))
        return

    def body(i, acc):
        cols = pl.ds(base + i * bk, bk)
        w = w_ref[:, cols].astype(jnp.bfloat16)
        return acc + jax.lax.dot_general(x_ref[:, cols], w, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
    o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros((bm, bn), jnp.float32))


@functools.partial(jax.jit, static_argnames=("mode", "out_dtype", "plan", "interpret"))
def int8_rows(x: Float[Array, "m k"], w: Int8[Array, "n k"], sw: Float[Array, "..."],
              bias: Optional[Float[Array, " n"]] = None, *, mode: str = "w8a8",
              out_dtype=jnp.float32, plan: Optional[Plan] = None, interpret: bool = False):
    """y [M, N] = x [M, K] @ (w [N, K] · sw)ᵀ (+ bias), ``sw`` [N] or []: ``w8a8`` quantizes x
    per token first (the numbers of ``reference.quantize_per_token`` then
    ``reference.w8a8_matmul``), ``w8`` multiplies x rounded to bfloat16 by the int8 weight."""
    if mode not in MODES:
        raise ValueError(f"int8_rows mode {mode!r} is unknown; choose w8a8 or w8")
    M, K = x.shape
    N = w.shape[0]
    if w.ndim != 2 or w.shape[1] != K or w.dtype != jnp.int8:
        raise ValueError(f"int8_rows needs x [M, K] and an int8 w [N, K] (K-major); got "
                         f"{x.shape} and {w.dtype.name} {w.shape}")
    if M > MAX_ROWS:
        raise ValueError(f"int8_rows is for decode's few rows (M <= {MAX_ROWS}), got {M}: "
                         f"use w8a8_matmul (pallas_kernels) for prefill")
    p = plan or plan_for(M, N, K)
    Mp, Np, Kp = max(16, -(-M // 16) * 16), -(-N // p.bn) * p.bn, -(-K // p.bk) * p.bk
    if (Np, Kp) != (N, K):  # only for weights no block divides (see plan_for)
        w = jnp.pad(w, ((0, Np - N), (0, Kp - K)))
    xf = x.astype(jnp.float32)
    if mode == "w8a8":
        m = jnp.max(jnp.abs(xf), -1, keepdims=True)
        scale = jnp.where(m > 0, m / ref.QMAX, 1.0)  # [M, 1], reference.quantize_per_token's
        xk = xf
    else:
        scale = jnp.ones((M, 1), jnp.float32)
        xk = x.astype(jnp.bfloat16)
    xk = jnp.pad(xk, ((0, Mp - M), (0, Kp - K)))
    sp = jnp.pad(scale, ((0, Mp - M), (0, 0)), constant_values=1.0)
    acc_dtype = jnp.int32 if mode == "w8a8" else jnp.float32
    nk = Kp // p.bk
    steps = -(-nk // p.splits)
    from jax.experimental.pallas import triton as pl_triton
    parts = pl.pallas_call(
        functools.partial(_kernel, steps=steps, nk=nk, bk=p.bk, mode=mode),
        grid=(Np // p.bn, p.splits),
        in_specs=[pl.BlockSpec((Mp, Kp), lambda j, s: (0, 0)),
                  pl.BlockSpec((Mp, 1), lambda j, s: (0, 0)),
                  pl.BlockSpec((p.bn, Kp), lambda j, s: (j, 0))],
        out_specs=pl.BlockSpec((None, Mp, p.bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((p.splits, Mp, Np), acc_dtype),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * Mp * Np * Kp, transcendentals=0,
                                      bytes_accessed=Np * Kp + 4 * Mp * Kp
                                      + 4 * p.splits * Mp * Np),
        compiler_params=pl_triton.CompilerParams(num_warps=p.num_warps,
                                                 num_stages=p.num_stages),
    )(xk, sp, w)
    acc = jnp.sum(parts, axis=0)[:M, :N]  # int32 (exact) for w8a8
    sw = jnp.broadcast_to(jnp.asarray(sw, jnp.float32), (N,))
    y = acc.astype(jnp.float32) * sw[None, :]
    if mode == "w8a8":
        y = y * scale
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


def reference(x, w, sw, bias=None, *, mode: str = "w8a8", out_dtype=jnp.float32):
    """:func:`int8_rows` in jnp: per-token quantization and the exact int8 product (w8a8), or
    x rounded to bfloat16 times the widened weight in float32 (w8)."""
    N = w.shape[0]
    sw = jnp.broadcast_to(jnp.asarray(sw, jnp.float32), (N,))
    if mode == "w8a8":
        q, sx = ref.quantize_per_token(x)
        return ref.w8a8_matmul(q, w, sx, sw, bias, out_dtype)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.einsum("mk,nk->mn", xb, w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * sw[None, :]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)
