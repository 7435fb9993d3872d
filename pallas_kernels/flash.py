"""The Pallas kernel of blockwise attention (jaxllm.attention.flash): one segment of keys folded
into the online softmax's running state ("FlashAttention-2", Dao 2023, Algorithm 1), with the
mask computed per block from positions, never stored:

    visible(q, k) = k_ok[k] and 0 <= q_pos[q] - k_pos[k] < span

and ALiBi's bias -slope[h] * (q_pos - k_pos). The state (running max m, sum l, unnormalised
output acc) goes in and comes out, aliased, so a chunk's segments (sinks, ring, the chunk
itself) chain through one state without concatenating the cache.

Two lowerings of the same block update (``_update``), as in pallas_kernels.matmul:

* ``triton`` (GPU): a grid over (batch, head, query block); each program walks the keys in
  ``bk`` steps (``fori_loop``), the state in registers.
* ``tpu`` (Mosaic TPU): a grid (batch, head, query block, key block), the key axis last and
  "arbitrary", the state in VMEM scratch, read at the first key block and written at the last.

Queries and keys come rotated (RoPE applied). Both run on CPU in interpret mode; the jnp
reference is jaxllm.attention.flash.reference (its blockwise form is the same algorithm).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import NEG_INF

NO_SPAN = 2 ** 30  # "no window": larger than any distance


@dataclasses.dataclass(frozen=True)
class Blocks:
    bq: int
    bk: int
    num_warps: int = 4  # triton
    num_stages: int = 2  # triton


def default_blocks(backend: str) -> Blocks:
    """GPU: 64 x 64 tiles (a query block and a key block of head dim 128 in registers). TPU:
    128 x 128, the lane width (key positions are a row of the block, so bk % 128 == 0)."""
    return Blocks(64, 64) if backend == "triton" else Blocks(128, 128)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _update(q, k, v, qp, kp, ok, slope, m, l, acc, *, span: int, scale: float):
    """One key block: q [bq, Dh], k, v [bk, Dh], qp [bq, 1], kp and ok [1, bk] (int32),
    slope [1, 1] float32, m and l [bq, 1], acc [bq, Dh] -> the new (m, l, acc)."""
    # Products of 16-bit queries and keys are exact in float32, the accumulation's type: the
    # scores of the float32 reference, from the 16-bit operands (tensor cores on a GPU).
    dt = jnp.promote_types(q.dtype, k.dtype)
    s = jax.lax.dot_general(q.astype(dt), k.astype(dt), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [bq, bk]
    dist = qp - kp  # [bq, bk]
    s = s - slope * dist.astype(jnp.float32)
    visible = (ok != 0) & (dist >= 0) & (dist < span)
    s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    fix = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(p, v.astype(jnp.float32), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_new, l * fix + jnp.sum(p, axis=1, keepdims=True), acc * fix + pv


def _triton_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, ok_ref, sl_ref, m_ref, l_ref, a_ref,
                   mo_ref, lo_ref, ao_ref, *, nk: int, bk: int, span: int, scale: float):
    q, qp, slope = q_ref[...], qp_ref[...], sl_ref[...]

    def body(j, carry):
        ks = pl.ds(j * bk, bk)
        return _update(q, k_ref[ks, :], v_ref[ks, :], qp, kp_ref[:, ks], ok_ref[:, ks], slope,
                       *carry, span=span, scale=scale)

    m, l, acc = jax.lax.fori_loop(0, nk, body, (m_ref[...], l_ref[...], a_ref[...]))
    mo_ref[...], lo_ref[...], ao_ref[...] = m, l, acc


def _tpu_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, ok_ref, sl_ref, m_ref, l_ref, a_ref,
                mo_ref, lo_ref, ao_ref, m_s, l_s, a_s, *, nk: int, span: int, scale: float):
    j = pl.program_id(3)  # grid (batch, head, query block, key block)

    @pl.when(j == 0)
    def _():
        m_s[...], l_s[...], a_s[...] = m_ref[...], l_ref[...], a_ref[...]

    m_s[...], l_s[...], a_s[...] = _update(
        q_ref[...], k_ref[...], v_ref[...], qp_ref[...], kp_ref[...], ok_ref[...], sl_ref[...],
        m_s[...], l_s[...], a_s[...], span=span, scale=scale)

    @pl.when(j == nk - 1)
    def _():
        mo_ref[...], lo_ref[...], ao_ref[...] = m_s[...], l_s[...], a_s[...]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad(a, axis: int, size: int, value=0):
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths, constant_values=value)


@functools.partial(jax.jit, static_argnames=("span", "backend", "blocks", "interpret"))
def flash_segment(m, l, acc, q, k, v, q_pos, k_pos, k_ok, slopes=None, *,
                  span: Optional[int] = None, backend: str = "triton",
                  blocks: Optional[Blocks] = None, interpret: bool = False):
    """Fold one segment into the running state.

    m, l [B, H, T] and acc [B, H, T, Dh] float32 (head-major); q [B, H, T, Dh] rotated;
    k, v [B, KVH, L, Dh] rotated (H a multiple of KVH: grouped queries); q_pos [B, T],
    k_pos [B, L] int32; k_ok [B, L] bool; slopes [H] float32 or None (no ALiBi); ``span``
    the window (None: none). Returns the new (m, l, acc)."""
    B, H, T, Dh = q.shape
    KVH, L = k.shape[1], k.shape[2]
    _check(k.shape == v.shape == (B, KVH, L, Dh) and H % KVH == 0,
           f"flash_segment needs k, v [B, KVH, L, Dh] with H % KVH == 0 for q {q.shape}; got "
           f"{k.shape} and {v.shape}")
    _check(m.shape == l.shape == (B, H, T) and acc.shape == (B, H, T, Dh),
           f"the state must be m, l {(B, H, T)} and acc {(B, H, T, Dh)}; got {m.shape}, "
           f"{l.shape}, {acc.shape}")
    _check(q_pos.shape == (B, T) and k_pos.shape == k_ok.shape == (B, L),
           f"positions must be q_pos {(B, T)}, k_pos and k_ok {(B, L)}; got {q_pos.shape}, "
           f"{k_pos.shape}, {k_ok.shape}")
    G = H // KVH
    b = blocks or default_blocks(backend)
    Tp, Lp = _round_up(T, b.bq), _round_up(L, b.bk)
    # Padded keys are not ok (never visible); padded queries are sliced off.
    q, m, l, acc = (_pad(a, 2, Tp) for a in (q, m, l, acc))
    k, v = _pad(k, 2, Lp), _pad(v, 2, Lp)
    qp = _pad(q_pos.astype(jnp.int32), 1, Tp)[..., None]  # [B, Tp, 1]: a column per block
    kp = _pad(k_pos.astype(jnp.int32), 1, Lp)[:, None]  # [B, 1, Lp]: a row per block
    ok = _pad(k_ok.astype(jnp.int32), 1, Lp)[:, None]
    sl = (jnp.zeros((H,), jnp.float32) if slopes is None else
          slopes.astype(jnp.float32)).reshape(H, 1, 1)
    m, l = m[..., None], l[..., None]  # [B, H, Tp, 1]: columns, like the scores' rows
    kw = dict(span=NO_SPAN if span is None else span, scale=1.0 / math.sqrt(Dh))
    nq, nk = Tp // b.bq, Lp // b.bk
    out_shape = [jax.ShapeDtypeStruct(m.shape, jnp.float32),
                 jax.ShapeDtypeStruct(l.shape, jnp.float32),
                 jax.ShapeDtypeStruct(acc.shape, jnp.float32)]
    cost = pl.CostEstimate(flops=4 * B * H * Tp * Lp * Dh, transcendentals=B * H * Tp * Lp,
                           bytes_accessed=q.dtype.itemsize * B * H * Tp * Dh
                           + k.dtype.itemsize * 2 * B * H * nq * Lp * Dh
                           + 8 * B * H * Tp * (Dh + 2))
    if backend == "triton":
        from jax.experimental.pallas import triton as pl_triton
        state = lambda: pl.BlockSpec((None, None, b.bq, 1), lambda z, h, i: (z, h, i, 0))
        kv = lambda: pl.BlockSpec((None, None, Lp, Dh),
                                  lambda z, h, i: (z, jax.lax.div(h, G), 0, 0))
        out = pl.pallas_call(
            functools.partial(_triton_kernel, nk=nk, bk=b.bk, **kw),
            grid=(B, H, nq),
            in_specs=[pl.BlockSpec((None, None, b.bq, Dh), lambda z, h, i: (z, h, i, 0)),
                      kv(), kv(),
                      pl.BlockSpec((None, b.bq, 1), lambda z, h, i: (z, i, 0)),
                      pl.BlockSpec((None, 1, Lp), lambda z, h, i: (z, 0, 0)),
                      pl.BlockSpec((None, 1, Lp), lambda z, h, i: (z, 0, 0)),
                      pl.BlockSpec((None, 1, 1), lambda z, h, i: (h, 0, 0)),
                      state(), state(),
                      pl.BlockSpec((None, None, b.bq, Dh), lambda z, h, i: (z, h, i, 0))],
            out_specs=[state(), state(),
                       pl.BlockSpec((None, None, b.bq, Dh), lambda z, h, i: (z, h, i, 0))],
            out_shape=out_shape, input_output_aliases={7: 0, 8: 1, 9: 2},
            interpret=interpret, cost_estimate=cost,
            compiler_params=pl_triton.CompilerParams(num_warps=b.num_warps,
                                                     num_stages=b.num_stages),
        )(q, k, v, qp, kp, ok, sl, m, l, acc)
    elif backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        state = lambda: pl.BlockSpec((None, None, b.bq, 1), lambda z, h, i, j: (z, h, i, 0))
        kv = lambda: pl.BlockSpec((None, None, b.bk, Dh),
                                  lambda z, h, i, j: (z, jax.lax.div(h, G), j, 0))
        out = pl.pallas_call(
            functools.partial(_tpu_kernel, nk=nk, **kw),
            grid=(B, H, nq, nk),
            in_specs=[pl.BlockSpec((None, None, b.bq, Dh), lambda z, h, i, j: (z, h, i, 0)),
                      kv(), kv(),
                      pl.BlockSpec((None, b.bq, 1), lambda z, h, i, j: (z, i, 0)),
                      pl.BlockSpec((None, 1, b.bk), lambda z, h, i, j: (z, 0, j)),
                      pl.BlockSpec((None, 1, b.bk), lambda z, h, i, j: (z, 0, j)),
                      pl.BlockSpec((None, 1, 1), lambda z, h, i, j: (h, 0, 0)),
                      state(), state(),
                      pl.BlockSpec((None, None, b.bq, Dh), lambda z, h, i, j: (z, h, i, 0))],
            out_specs=[state(), state(),
                       pl.BlockSpec((None, None, b.bq, Dh), lambda z, h, i, j: (z, h, i, 0))],
            out_shape=out_shape, input_output_aliases={7: 0, 8: 1, 9: 2},
            scratch_shapes=[pltpu.VMEM((b.bq, 1), jnp.float32),
                            pltpu.VMEM((b.bq, 1), jnp.float32),
                            pltpu.VMEM((b.bq, Dh), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=pltpu.InterpretParams() if interpret else False, cost_estimate=cost,
        )(q, k, v, qp, kp, ok, sl, m, l, acc)
    else:
        raise ValueError(f"unknown Pallas backend {backend!r}; use triton or tpu")
    m, l, acc = out
    return m[:, :, :T, 0], l[:, :, :T, 0], acc[:, :, :T]
