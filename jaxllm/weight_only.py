"""Weight-only products: x times an int8 (W8) or 2-byte float weight kept [out, in]
(jaxllm.quant.decode_weights makes such nodes), in the forms each platform reads fastest, and
the barrier that keeps a decode loop from hoisting the weights' widening out of it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import pallas_kernels
from pallas_kernels import cpu as cpu_kernels
from pallas_kernels.reference import after, computed_once

from .bits import in_widened_groups


def loop_weights(params, step: Array):
    """``(params, step)`` as the body of a ``while_loop`` or ``scan`` must use them: tied by an
    ``optimization_barrier`` to ``step``, a value that changes every iteration. The body must
    use the returned ``step`` (XLA drops a barrier's unused outputs, and the tie with them).

    XLA's loop-invariant code motion moves any op whose operands do not change across
    iterations out of the loop. Left alone, it moves the widening of int8 or bfloat16 weights to
    float32 out of the decode loop: the loop then reads a float32 copy of every weight (4x W8's
    bytes) and that copy sits in memory for the whole loop (measured: docs/CPU.md, "Weight-only
    products"). A barrier over the weights alone does not hold: it is invariant too, and moves
    with them.
    """
    return jax.lax.optimization_barrier((params, step))



# Rows per fused row reduction (below); from MANY_ROWS on, one float copy of the weight and one
# GEMM.
REDUCE_ROWS = 32
MANY_ROWS = 64
# XLA:CPU fuses the weight's conversion into a one-row product only up to this input width
# (3,072 fused, 4,096 not; the unfused form writes the whole float weight each call).
VECMAT_MAX_IN = 3072


def weight_only_matmul(x: Float[Array, "... i"], q: Array, scale: Float[Array, "..."],
                       dtype=jnp.float32, backend: str = "auto") -> Float[Array, "... o"]:
    """x @ (q · scale)ᵀ for a weight-only kernel ``q`` [out, in] (int8, or bfloat16/float16 from
    :func:`decode_weights`): ``(x @ qᵀ) · scale``, the per-channel or per-tensor scale applied to
    the product (an outer dimension, as eq. 2).

    On CPU decode's few rows go to the C++ kernel that widens the weight in registers
    (pallas_kernels.cpu.float_rows; ``backend="xla"`` keeps XLA's forms), else to XLA forms
    that read the narrow weight in one loop, and only many rows (prefill) convert it whole, in
    float32 (why: docs/CPU.md, "Weight-only products" and "Float products"); elsewhere XLA
    fuses the conversion into the dot's operand, which is exact (an int8 code fits bfloat16's
    8-bit significand).

    Everywhere the product is summed in float32 and scaled in float32, and the result is
    rounded to ``dtype`` once: a bfloat16 dot result scaled in bfloat16 was rounded three times
    (the sum, the scale, the scaled product), up to 1% off on a GPU (tests/test_smoothquant.py).
    """
    lead, (n_out, n_in) = x.shape[:-1], q.shape
    cpu = jax.default_backend() == "cpu"
    if (q.dtype == jnp.int8 and jnp.dtype(dtype) == jnp.bfloat16
            and pallas_kernels.resolve_backend(backend) == "triton"
            and x.size // n_in <= pallas_kernels.rows.MAX_ROWS):
        # Decode on a GPU: the split-K kernel reads the int8 weight once, converting it in
        # registers (the same bfloat16 x int8 products summed in float32 as the form below).
        y = pallas_kernels.w8_matmul(x.reshape(-1, n_in), q, scale)
        return y.reshape(*lead, n_out).astype(dtype)
    compute = jnp.float32 if cpu else dtype
    x2 = x.reshape(-1, n_in).astype(dtype).astype(compute)  # rounded to dtype, then widened
    m = x2.shape[0]
    if (cpu and pallas_kernels.resolve_backend(backend) == "cpu"
            and cpu_kernels.float_use_for(m, n_in, q.dtype) and (m > 1 or n_in > VECMAT_MAX_IN)):
        # Each weight row read once for all the rows, widened in registers: XLA's forms read it
        # at a third of the memory's rate from two rows on, and at one row of a wide input;
        # one row of a narrower one is XLA's fused vector-matrix product, as fast (docs/CPU.md,
        # "Float products"). A program lowered for another platform takes the XLA form.
        y = cpu_kernels.on_cpu(lambda x2: cpu_kernels.float_rows(x2, q),
                               lambda x2: _xla_product(x2, q, compute), x2)
    else:
        y = _xla_product(x2, q, compute)
    return (y * scale.astype(jnp.float32)).astype(dtype).reshape(*lead, n_out)


def _xla_product(x2: Float[Array, "m i"], q: Array, compute) -> Float[Array, "m o"]:
    """x2 @ qᵀ in ``compute`` by XLA, in the form that reads ``q`` fastest for ``x2``'s
    number of rows (weight_only_matmul's)."""
    cpu = jax.default_backend() == "cpu"
    m, n_in = x2.shape
    if not cpu or m >= MANY_ROWS:
        # Many rows amortise one float copy of the weight over a large GEMM, which runs faster
        # whole than in pieces.
        w = q.astype(compute)
        if cpu:  # converted as the layer runs, not every layer's at the start (elsewhere
            w = after(x2, w)  # the conversion fuses into the dot: no copy to schedule)
        y = jnp.einsum("mi,oi->mo", x2, w, preferred_element_type=jnp.float32)
    else:
        # The input is materialised first, or XLA would fuse the LayerNorm producing it into the
        # product and recompute it for every output.
        x2 = computed_once(x2)
        if m == 1 and n_in <= VECMAT_MAX_IN:
            # One row: a vector-matrix product, which XLA:CPU emits as a loop fusion that takes
            # the conversion in.
            y = x2 @ q.astype(compute).T
        else:
            # Several rows (or a wide input): an elementwise product summed over the input's
            # minor dimension, one loop that reads each weight row once for all the rows. Past
            # 32 rows XLA stops fusing it, so groups of 32; one row is padded to two, as XLA
            # turns a one-row reduction back into the unfused dot.
            def rows_product(xg):  # [g, in] -> [g, out]
                # Two barriers, each against a rewrite that would materialise the [out, g, in]
                # product: tying the input to its own weight keeps q, k and v (which share an
                # input) from sharing one broadcast of it, and fencing the sum keeps a following
                # LayerNorm's mean from being merged into this reduction.
                xg, qg = jax.lax.optimization_barrier((xg, q))
                prod = qg.astype(compute)[:, None, :] * xg[None]
                return jax.lax.optimization_barrier(jnp.sum(prod, axis=-1)).T
            if m == 1:
                y = rows_product(jnp.concatenate([x2, x2]))[:1]
            elif q.dtype == jnp.float16:
                # XLA:CPU converts float16 element by element, so the fused loop paid one
                # conversion per weight and row; widened a block of output rows at a time into a
                # small float32 buffer it is one GEMM per block (int8 and bfloat16 weights do
                # better in the fused loop).
                y = in_widened_groups(lambda w: w @ x2.T, q).T
            else:
                y = jnp.concatenate([rows_product(x2[g:g + REDUCE_ROWS])
                                     for g in range(0, m, REDUCE_ROWS)])
    return y
