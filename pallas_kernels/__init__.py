"""The kernels under the library, one module each beside its jnp reference (``reference``):

* Pallas (GPU: Triton lowering; TPU: Mosaic), each with an interpret-mode test on CPU and a
  test that lowers it for its devices: ``matmul`` (INT8 W8A8 products, per-token quantization
  fused with a norm, the batched attention product), ``rows`` (decode's split-K int8
  products), ``packed_matmul`` (products with 2/4/8-bit packed weights), ``flash`` (blockwise
  attention for long prefills), ``decode`` (decode attention over a KV cache as stored);
* CPU: ``cpu`` and ``csrc/`` (hand-written C++ FFI kernels for AVX-512 CPUs: few-row int8
  products, decode attention), built on first use, XLA's forms where they are not available.

This module dispatches the INT8 products by backend: ``w8a8_matmul``, ``quantize_per_token``
(optionally fused with LayerNorm/RMSNorm) and ``int8_bmm`` pick the Pallas kernel on GPU (Triton
lowering) and TPU (Mosaic), ``cpu`` on CPUs and the pure-jnp reference (XLA) elsewhere. ``cpu``
is XLA's too, except the few-row products (decode) of ``w8a8_matmul`` and
``w8a8_matmul_per_token`` on a CPU with AVX-512 VNNI: those go to a hand-written FFI kernel
(:mod:`pallas_kernels.cpu`; exact, the same int32 sums). Override with ``backend=`` (``xla`` |
``cpu`` | ``triton`` | ``tpu``; jaxllm passes its ``ModelConfig.kernels.int8``);
``interpret=True`` runs a Pallas backend on CPU.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from . import cpu
from . import matmul as _k
from . import reference, rows
from .matmul import Blocks, default_blocks

BACKENDS = ("xla", "cpu", "triton", "tpu")


def resolve_backend(backend: Optional[str] = None) -> str:
    """``backend``, or for ``auto`` (and None) by platform: triton on GPU, tpu on TPU, cpu on
    CPU, xla elsewhere."""
    b = backend or "auto"
    if b == "auto":
        return {"gpu": "triton", "tpu": "tpu", "cpu": "cpu"}.get(jax.default_backend(), "xla")
    if b not in BACKENDS:
        raise ValueError(f"unknown INT8 backend {b!r}; choose auto, {', '.join(BACKENDS)} "
                         f"(argument backend=)")
    return b


def w8a8_matmul(x, w, sx, sw, bias=None, out_dtype=jnp.float32, *,
                backend: Optional[str] = None, interpret: bool = False,
                blocks: Optional[Blocks] = None):
    """y [M, N] = (x [M, K] int8 · w [N, K]ᵀ int8, int32) · sx · sw (+ bias); sx [M] or [],
    sw [N] or []."""
    b = resolve_backend(backend)
    if b in ("xla", "cpu"):
        M, N = x.shape[0], w.shape[0]
        sx = jnp.broadcast_to(jnp.asarray(sx, jnp.float32), (M,))
        sw = jnp.broadcast_to(jnp.asarray(sw, jnp.float32), (N,))
        if b == "cpu" and cpu.use_for(M, x.shape[1]):
            acc = cpu.on_cpu(cpu.int8_rows, reference.int8_matmul, x, w)
            return acc if jnp.dtype(out_dtype) == jnp.int32 else reference.epilogue(
                acc, sx, sw, bias, out_dtype)
        return reference.w8a8_matmul(x, w, sx, sw, bias, out_dtype)
    return _k.w8a8_matmul(x, w, sx, sw, bias, out_dtype, backend=b, blocks=blocks,
                          interpret=interpret)


def w8a8_matmul_per_token(x, w, sw, bias=None, out_dtype=jnp.float32, *,
                          backend: Optional[str] = None, interpret: bool = False,
                          blocks: Optional[Blocks] = None):
    """``w8a8_matmul`` of float rows x [M, K] quantized per token first (SmoothQuant's O1): each
    row to int8 with its own absmax scale (``reference.quantize_per_token``), then
    y [M, N] = (q · wᵀ) · sx · sw (+ bias). On ``cpu`` at few rows one kernel call does both,
    exactly (the same scales and int8 rows; :func:`cpu.int8_rows_token`); decode then runs no
    separate XLA loops for the quantization. On ``triton`` at few rows (decode), the split-K
    kernel :func:`rows.int8_rows` quantizes the rows as it reads them (the same numbers)."""
    b = resolve_backend(backend)
    x = jnp.asarray(x, jnp.float32)
    if b == "triton" and x.shape[0] <= rows.MAX_ROWS and blocks is None:
        return rows.int8_rows(x, w, sw, bias, mode="w8a8", out_dtype=out_dtype,
                              interpret=interpret)
    if b == "cpu" and cpu.use_for(x.shape[0], x.shape[1]):
        def by_xla(x, w):
            q, sx = reference.quantize_per_token(x)
            return reference.int8_matmul(q, w), sx
        acc, sx = cpu.on_cpu(cpu.int8_rows_token, by_xla, x, w)
        sw = jnp.broadcast_to(jnp.asarray(sw, jnp.float32), (w.shape[0],))
        return reference.epilogue(acc, sx, sw, bias, out_dtype)
    q, sx = reference.quantize_per_token(x)
    return w8a8_matmul(q, w, sx, sw, bias, out_dtype, backend=b, interpret=interpret,
                       blocks=blocks)


def w8_matmul(x, w, sw, out_dtype=jnp.float32, *, backend: Optional[str] = None,
              interpret: bool = False):
    """Weight-only y [M, N] = x [M, K] (rounded to bfloat16) · (w [N, K] int8 · sw)ᵀ, summed in
    float32: on ``triton`` at few rows the split-K kernel (:func:`rows.int8_rows`, the weight
    converted in registers), else XLA's dot with the conversion as its operand."""
    if resolve_backend(backend) == "triton" and x.shape[0] <= rows.MAX_ROWS:
        return rows.int8_rows(x, w, sw, mode="w8", out_dtype=out_dtype, interpret=interpret)
    return rows.reference(x, w, sw, mode="w8", out_dtype=out_dtype)


def quantize_per_token(x, gamma=None, beta=None, *, norm: Optional[str] = None,
                       eps: float = 1e-5, backend: Optional[str] = None,
                       interpret: bool = False):
    """(q [M, D] int8, scale [M]) of the (optionally normalised) rows of x [M, D]."""
    b = resolve_backend(backend)
    if b in ("xla", "cpu"):
        return reference.quantize_per_token(x, norm, gamma, beta, eps)
    return _k.quantize_per_token(x, gamma, beta, norm=norm, eps=eps, backend=b,
                                 interpret=interpret)


def int8_bmm(a, b, sa, sb, out_dtype=jnp.float32, *, backend: Optional[str] = None,
             interpret: bool = False):
    """[B, M, K] x [B, N, K] int8 -> [B, M, N] with scales sa [B, M], sb [B, N]."""
    be = resolve_backend(backend)
    if be in ("xla", "cpu"):
        return reference.int8_bmm(a, b, sa, sb, out_dtype)
    return _k.int8_bmm(a, b, sa, sb, out_dtype, backend=be, interpret=interpret)


__all__ = ["BACKENDS", "Blocks", "default_blocks", "int8_bmm", "quantize_per_token",
           "reference", "resolve_backend", "rows", "w8_matmul", "w8a8_matmul",
           "w8a8_matmul_per_token"]
