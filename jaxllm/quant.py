"""INT8 tensors and matmuls (SmoothQuant, Xiao et al. 2023, §2 and docs/METHODS.md §3).

Symmetric quantization: Δ = max|X| / 127, X̄ = clip(round(X / Δ), -127, 127). An INT8 GEMM can
only rescale along its outer dimensions, Y = diag(Δ_X) (X̄ W̄) diag(Δ_W) (eq. 2), so activation
scales are per token (rows) or per tensor, and weight scales per output channel or per tensor.

A quantized weight is a :class:`QKernel` pytree node in place of the float ``kernel`` leaf: the
int8 values and their scale are ordinary leaves, and how activations are quantized is static
metadata of the node, so ``jit`` specialises on it and ``forward``/``generate`` take quantized
params unchanged. ``Linear`` (and the embedding) dispatch on the node type.
"""
from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, Int8, UInt16

import pallas_kernels
from pallas_kernels.reference import QMAX, computed_once

from . import tree

ACT_MODES = ("token", "tensor", "static", "none")


@struct.dataclass
class QKernel:
    """An int8 weight ``q`` [out, in] with ``scale`` [out] (per channel) or [] (per tensor); or a
    float weight kept [out, in] for decoding (float32/bfloat16/float16 ``q``, scale 1,
    ``act="none"``: :func:`decode_weights`).

    ``q`` is stored K-major ([out, in], the transpose of the float kernel): the layout int8 GEMMs
    want (Hopper's wgmma requires it; XLA on this CPU runs it 3x faster than [in, out]).

    ``act``: how the input is quantized — ``token`` (dynamic, per row), ``tensor`` (dynamic, per
    call), ``static`` (the calibrated ``act_scale``), ``none`` (weight-only: dequantize and multiply
    in float). ``real``: int8 x int8 -> int32 matmul; otherwise fake-quant (quantize-dequantize
    and multiply in float32), for accuracy studies. Embedding tables use the same node with
    ``q`` [vocab, dim] and a per-row ``scale`` [vocab].
    """

    q: Int8[Array, "o i"]
    scale: Float[Array, "..."]
    act_scale: Optional[Float[Array, ""]] = None
    act: Literal["token", "tensor", "static", "none"] = struct.field(pytree_node=False,
                                                                     default="token")
    real: bool = struct.field(pytree_node=False, default=True)

    @property
    def shape(self):
        return self.q.shape


def absmax_scale(x: Array, axis=None, keepdims: bool = False) -> Array:
    """Δ = max|x| / 127 over ``axis`` (all-zero slices get Δ = 1 so nothing divides by zero)."""
    m = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=keepdims)
    return jnp.where(m > 0, m / QMAX, 1.0)


def quantize(x: Array, scale: Array) -> Int8[Array, "..."]:
    """round(x / scale) clipped to [-127, 127], as int8 (``scale`` broadcasts against ``x``)."""
    return jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -QMAX, QMAX).astype(jnp.int8)


def quantize_weight(w: Float[Array, "i o"], per_channel: bool, act: str = "token",
                    act_scale: Optional[Array] = None, real: bool = True) -> QKernel:
    """A float kernel [in, out] as a :class:`QKernel` ([out, in]; per output channel or per
    tensor)."""
    if act not in ACT_MODES:
        raise ValueError(f"unknown activation mode {act!r}; choose one of {ACT_MODES}")
    if (act == "static") != (act_scale is not None):
        raise ValueError("act='static' needs act_scale (a calibrated per-tensor scale), and only "
                         "it takes one")
    wt = w.T  # [out, in]
    scale = absmax_scale(wt, axis=1) if per_channel else absmax_scale(wt)
    return QKernel(quantize(wt, scale[:, None] if per_channel else scale), scale, None if act_scale is None else
                   jnp.asarray(act_scale, jnp.float32), act=act, real=real)


def quantize_rows(table: Float[Array, "v d"], act: str = "token", real: bool = True) -> QKernel:
    """An embedding table with one scale per row (token): a lookup dequantizes its rows exactly,
    and a tied output head uses the per-row scales as per-output-channel scales."""
    scale = absmax_scale(table, axis=1)
    return QKernel(quantize(table, scale[:, None]), scale, act=act, real=real)


HALF_DTYPES = ("bfloat16", "float16")
DECODE_DTYPES = ("float32",) + HALF_DTYPES


def decode_weights(params, dtype: str = "bfloat16") -> dict:
    """Float params with every linear kernel and the embedding table stored [out, in] in
    ``dtype`` (float32, bfloat16 or float16), as weight-only nodes: a :class:`QKernel` with ``q``
    the weight [out, in], a scale of 1 and ``act="none"``. Norms, biases and position tables
    stay float32. The layout for decoding on a CPU; training and converters take the plain
    params.

    Why this layout on a CPU, with its measurements: docs/CPU.md, "Weights for decoding".
    Products run in float32 on CPU (in the config's dtype elsewhere); ``forward``/``generate``
    take the result unchanged, and ``jaxllm.io.save_model`` writes it (as ``q``/``scale``
    pairs).
    """
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"decode_weights stores float32, bfloat16 or float16 weights, got "
                         f"{dtype!r} (int8 weights: jaxllm.smoothquant.quantize)")
    flat = tree.flatten(params)
    if any(isinstance(x, (QKernel, QAttention)) for x in flat.values()):
        raise ValueError("these params hold quantized or weight-only nodes already; convert "
                         "the float model")
    dt = jnp.dtype(dtype)
    out = {}
    for path, x in flat.items():
        if path.endswith("/kernel"):  # [in, out] -> [out, in], one scale for the tensor
            x = QKernel(jnp.asarray(x).T.astype(dt), jnp.ones((), jnp.float32), act="none")
        elif path == "embed/embedding":  # already [vocab, dim] = [out, in] as a tied head
            x = QKernel(jnp.asarray(x).astype(dt), jnp.ones(x.shape[:1], jnp.float32),
                        act="none")
        out[path] = x
    return tree.unflatten(out)


def half_weights(params, dtype: str = "bfloat16") -> dict:
    """:func:`decode_weights` in a 2-byte ``dtype`` (bfloat16 or float16): half float32's bytes.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half_weights stores bfloat16 or float16 weights, got {dtype!r}")
    return decode_weights(params, dtype)


def loop_weights(params, step: Array):
    """``(params, step)`` as the body of a ``while_loop`` or ``scan`` must use them: tied by an
    ``optimization_barrier`` to ``step``, a value that changes every iteration. The body must
    use the returned ``step`` (XLA drops a barrier's unused outputs, and the tie with them).

    XLA's loop-invariant code motion moves any op whose operands do not change across
    iterations out of the loop. Left alone, it moves the widening of int8 or bfloat16 weights to
    float32 out of the decode loop: the loop then reads a float32 copy of every weight (4x W8's
    bytes) and that copy sits in memory for the whole loop. Measured on Pythia-160M W8, batch 1:
    25.6 ms a token in ``generate`` against 8.9 ms a step outside a loop; tied, 9.5 ms. A barrier
    over the weights alone does not hold: it is invariant too, and moves with them.
    """
    return jax.lax.optimization_barrier((params, step))


def int8_matmul(xq: Int8[Array, "... k"], wq: Int8[Array, "n k"]) -> Int[Array, "... n"]:
    """int8 x int8 -> int32, exact: xq [..., K] against a K-major weight [N, K]."""
    lead = xq.shape[:-1]
    acc = pallas_kernels.reference.int8_matmul(xq.reshape(-1, xq.shape[-1]), wq)
    return acc.reshape(*lead, wq.shape[0])


def act_scale_of(x: Array, k: QKernel) -> Array:
    """The input's scale for this weight's activation mode, shaped to broadcast over ``x``."""
    if k.act == "token":
        return absmax_scale(x, axis=-1, keepdims=True)
    if k.act == "tensor":
        return absmax_scale(x)
    return k.act_scale


def qmatmul(x: Float[Array, "... i"], k: QKernel, dtype=jnp.float32) -> Float[Array, "... o"]:
    """x @ W for a quantized W (stored [out, in]), by the node's activation mode and real/fake
    setting. Scales are per output channel or per tensor."""
    if k.act == "none":  # weight-only: the int8 (or half) weight is widened next to the matmul
        return weight_only_matmul(x, k.q, k.scale, dtype)
    if k.q.dtype != jnp.int8:
        raise ValueError(f"a {k.q.dtype.name} weight is weight-only (act='none'); act={k.act!r} "
                         f"needs int8 weights (jaxllm.smoothquant.quantize)")
    lead = x.shape[:-1]
    if k.real and k.act == "token":  # the rows' quantization goes with the product (a CPU
        # kernel does both in one call at few rows; the numbers of the branch below under jit)
        y = pallas_kernels.w8a8_matmul_per_token(x.reshape(-1, x.shape[-1]), k.q, k.scale)
        return y.reshape(*lead, k.q.shape[0]).astype(dtype)
    sx = act_scale_of(x, k)
    xq = quantize(x, sx)
    if k.real:  # eq. 2: the scales are applied to the int32 product (outer dims only)
        # pallas_kernels dispatches: the Pallas kernel on GPU/TPU, XLA's dot_general elsewhere.
        y = pallas_kernels.w8a8_matmul(xq.reshape(-1, x.shape[-1]), k.q, sx, k.scale)
        return y.reshape(*lead, k.q.shape[0]).astype(dtype)
    # Fake quant: the same quantize-dequantize, multiplied in float32. The integer-valued product
    # is formed first (exact in float32 while |sum| < 2^24) and scaled after, as eq. 2 does, so
    # real and fake modes differ only by float rounding.
    acc = jnp.einsum("...i,oi->...o", xq.astype(jnp.float32), k.q.astype(jnp.float32))
    return (acc * sx * k.scale).astype(dtype)


# ---- narrow arrays widened a few rows at a time (XLA:CPU) --------------------------------------

def to_bits(x: Float[Array, "..."]) -> UInt16[Array, "..."]:
    """``x`` rounded to bfloat16, as its 16-bit patterns (kv.stores.Bf16Bits)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def widen_bits(bits: UInt16[Array, "..."]) -> Float[Array, "..."]:
    """bfloat16 bit patterns as the float32 values they stand for (exact: the top half of a
    float32 is a bfloat16)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


def widen(a: Array) -> Float[Array, "..."]:
    """``a`` as float32: bfloat16 bits (uint16) or any float array."""
    return widen_bits(a) if a.dtype == jnp.uint16 else a.astype(jnp.float32)


# The float32 copy of one group in_widened_groups makes: a few MiB, so that it is reused from the
# caches and the heap (a copy over glibc's 32 MiB mmap threshold is fresh memory every call,
# faulted in page by page on this VM).
WIDEN_BYTES = 4 << 20


def in_widened_groups(fn, narrow, *batched: Array) -> Array:
    """``fn(*narrow as float32, *batched)``, which maps axis 0 to axis 0 of its result;
    ``narrow`` is an array or a tuple of arrays with the same rows (axis 0). On CPU 2-byte
    ``narrow`` arrays (bfloat16 bits, float16) are widened a group of rows at a time, each
    array's float32 copy of the group at most WIDEN_BYTES, one group per iteration of a loop,
    with the same rows of ``batched``: XLA:CPU then widens into one small buffer instead of the
    whole array into new memory. A float16 KV cache's values product at 4,096 slots, batch 8:
    35 ms a layer widened whole, 2.5 in groups (float32 4.2). Exact either way: the same float32
    products of the same widened values (when the group size does not divide the rows, the
    last group overlaps the one before and writes the same values again)."""
    narrows = narrow if isinstance(narrow, tuple) else (narrow,)
    N = narrows[0].shape[0]
    g = min(N, max(1, WIDEN_BYTES // (max(a[0].size for a in narrows) * 4)))
    # A bfloat16 array (not bits) would be widened whole at every slice of the loop, since
    # XLA:CPU normalizes a bfloat16 dynamic slice's whole operand: it is widened once instead.
    if (g == N or any(a.dtype not in (jnp.uint16, jnp.float16) for a in narrows)
            or jax.default_backend() != "cpu"):
        return fn(*map(widen, narrows), *batched)
    arrays = narrows + batched

    def group(start):
        part = [jax.lax.dynamic_slice_in_dim(a, start, g, 0) for a in arrays]
        return fn(*map(widen, part[:len(narrows)]), *part[len(narrows):])

    shape = jax.eval_shape(group, 0)
    out = jnp.zeros((N,) + shape.shape[1:], shape.dtype)
    return jax.lax.fori_loop(0, -(-N // g), lambda i, out: jax.lax.dynamic_update_slice_in_dim(
        out, group(jnp.minimum(i * g, N - g)), jnp.minimum(i * g, N - g), 0), out)


# Rows per fused row reduction (below); from MANY_ROWS on, one float copy of the weight and one
# GEMM.
REDUCE_ROWS = 32
MANY_ROWS = 64
# XLA:CPU fuses the weight's conversion into a one-row product only up to this input width
# (measured: 3,072 fused, 4,096 not; the unfused form writes the whole float weight each call,
# 15-17x slower than float32 at Llama-7B shapes).
VECMAT_MAX_IN = 3072


def weight_only_matmul(x: Float[Array, "... i"], q: Array, scale: Float[Array, "..."],
                       dtype=jnp.float32) -> Float[Array, "... o"]:
    """x @ (q · scale)ᵀ for a weight-only kernel ``q`` [out, in] (int8, or bfloat16/float16 from
    :func:`decode_weights`): ``(x @ qᵀ) · scale``, the per-channel or per-tensor scale applied to
    the product (an outer dimension, as eq. 2).

    On CPU decode's few rows take forms that read the narrow weight in one loop, and only many
    rows (prefill) convert it whole, in float32 (why: docs/CPU.md, "Weight-only products");
    elsewhere XLA fuses the conversion into the dot's operand, which is exact (an int8 code fits
    bfloat16's 8-bit significand).

    Everywhere the product is summed in float32 and scaled in float32, and the result is
    rounded to ``dtype`` once: a bfloat16 dot result scaled in bfloat16 was rounded three times
    (the sum, the scale, the scaled product), up to 1% off on a GPU (tests/test_smoothquant.py).
    """
    lead, (n_out, n_in) = x.shape[:-1], q.shape
    cpu = jax.default_backend() == "cpu"
    if (q.dtype == jnp.int8 and jnp.dtype(dtype) == jnp.bfloat16
            and pallas_kernels.resolve_backend() == "triton"
            and x.size // n_in <= pallas_kernels.rows.MAX_ROWS):
        # Decode on a GPU: the split-K kernel reads the int8 weight once, converting it in
        # registers (the same bfloat16 x int8 products summed in float32 as the form below).
        y = pallas_kernels.w8_matmul(x.reshape(-1, n_in), q, scale)
        return y.reshape(*lead, n_out).astype(dtype)
    compute = jnp.float32 if cpu else dtype
    x2 = x.reshape(-1, n_in).astype(dtype).astype(compute)  # rounded to dtype, then widened
    m = x2.shape[0]
    if not cpu or m >= MANY_ROWS:
        # Many rows amortise one float copy of the weight over a large GEMM, which runs faster
        # whole than in pieces.
        y = jnp.einsum("mi,oi->mo", x2, q.astype(compute), preferred_element_type=jnp.float32)
    else:
        # The input is materialised first, or XLA would fuse the LayerNorm producing it into the
        # product and recompute it for every output.
        x2 = computed_once(x2)
        if m == 1 and n_in <= VECMAT_MAX_IN:
            # One row: a vector-matrix product, which XLA:CPU emits as a loop fusion that takes
            # the conversion in (Pythia-160M's head: 2.0 ms for int8, 3.1 for bfloat16, 6.9 for
            # float32; docs/BENCHMARKS.md, "Weight-only products").
            y = x2 @ q.astype(compute).T
        else:
            # Several rows (or a wide input): an elementwise product summed over the input's
            # minor dimension, one loop that reads each weight row once for all the rows (head,
            # 8 rows: 7.6 ms for int8, 9.0 for bfloat16, 14 for float32's GEMM; Llama-7B's MLP,
            # one row: 5.4 for int8, 6.2 for bfloat16). Past 32 rows XLA stops fusing it, so
            # groups of 32; one row is padded to two, as XLA turns a one-row reduction back into
            # the unfused dot.
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
                # conversion per weight and row (Pythia-160M's head, 8 rows: 50 ms); widened a
                # block of output rows at a time into a small float32 buffer it is one GEMM per
                # block (9.2 ms; int8 and bfloat16 weights do better in the fused loop).
                y = in_widened_groups(lambda w: w @ x2.T, q).T
            else:
                y = jnp.concatenate([rows_product(x2[g:g + REDUCE_ROWS])
                                     for g in range(0, m, REDUCE_ROWS)])
    return (y * scale.astype(jnp.float32)).astype(dtype).reshape(*lead, n_out)


# ---- attention BMMs -----------------------------------------------------------------------------

@struct.dataclass
class QAttention:
    """Marks a layer's attention BMMs as INT8 (the paper's O1-O3 run QKᵀ and PV in INT8 too).

    No arrays: every scale is dynamic along an outer dimension of its product — q per (token,
    head), k per (key, head), probabilities per query row, v per (head, channel) — so eq. 2 holds
    and the epilogue is exact. Stored as ``params[layer]["attn"]["int8_attention"]``.
    """

    real: bool = struct.field(pytree_node=False, default=True)


def _int8_einsum(eq: str, a: Array, b: Array, real: bool) -> Array:
    if real:  # exact int32 (contractions padded: see int8_einsum)
        return pallas_kernels.reference.int8_einsum(eq, a, b).astype(jnp.float32)
    return jnp.einsum(eq, a.astype(jnp.float32), b.astype(jnp.float32))


def qk_scores(q: Float[Array, "b t k g h"], k: Float[Array, "b k s h"], real: bool
              ) -> Float[Array, "b k g t s"]:
    """q·kᵀ with both sides int8, per-token (and head) scales; keys head-major."""
    scale_q, scale_k = absmax_scale(q, -1, True), absmax_scale(k, -1, True)
    acc = _int8_einsum("btkgh,bksh->bkgts", quantize(q, scale_q), quantize(k, scale_k), real)
    return (acc * jnp.einsum("btkg->bkgt", scale_q[..., 0])[..., None]
            * scale_k[:, :, None, None, :, 0])


def pv(p: Float[Array, "b k g t s"], v: Float[Array, "b k s h"], p_scale: Array, real: bool
       ) -> Float[Array, "b t k g h"]:
    """probs · v with int8 probs (row scale ``p_scale`` [b, k, g, t, 1], shared by all key
    parts of a row) and int8 v (head-major; per head and channel over its keys)."""
    sv = absmax_scale(v, 2, True)  # [b, k, 1, h]
    acc = _int8_einsum("bkgts,bksh->btkgh", quantize(p, p_scale), quantize(v, sv), real)
    return acc * jnp.einsum("bkgt->btkg", p_scale[..., 0])[..., None] * sv[:, None, :, :, :]


# ---- (de)serialisation: QKernel nodes <-> plain dicts plus a spec of their static fields --------

def to_plain(params) -> tuple[dict, dict]:
    """Nested dicts of arrays (for safetensors/orbax) and ``{path: {"act", "real"}}`` for every
    quantized node (``{"kind": "attention", "real"}`` for INT8 attention), path joined by '/'."""
    from .lowbit import QLowBit
    spec, flat = {}, {}
    for path, node in tree.flatten(params).items():
        if isinstance(node, QLowBit):  # k-bit weight-only (jaxllm.lowbit)
            spec[path] = {"kind": "lowbit", "bits": node.bits, "group": node.group,
                          "in_features": node.in_features}
            for name in ("codes", "scale", "offset"):
                flat[f"{path}/{name}"] = getattr(node, name)
        elif isinstance(node, QAttention):  # no arrays: only its spec entry
            spec[path] = {"kind": "attention", "real": node.real}
        elif isinstance(node, QKernel):
            spec[path] = {"act": node.act, "real": node.real}
            flat[f"{path}/q"], flat[f"{path}/scale"] = node.q, node.scale
            if node.act_scale is not None:
                flat[f"{path}/act_scale"] = node.act_scale
        else:
            flat[path] = node
    return tree.unflatten(flat), spec


def from_plain(plain: dict, spec: dict) -> dict:
    """Inverse of :func:`to_plain`."""
    flat = tree.flatten(plain)
    for path, s in spec.items():
        if path.endswith("/bmm"):  # INT8 attention's marker before it was named int8_attention
            path = path[:-len("bmm")] + "int8_attention"
        if s.get("kind") == "attention":
            flat[path] = QAttention(real=s["real"])
            continue
        if s.get("kind") == "lowbit":
            from .lowbit import QLowBit
            flat[path] = QLowBit(*(flat.pop(f"{path}/{n}") for n in ("codes", "scale", "offset")),
                                 bits=s["bits"], group=s["group"], in_features=s["in_features"])
            continue
        q, scale = flat.pop(f"{path}/q"), flat.pop(f"{path}/scale")
        flat[path] = QKernel(q, scale, flat.pop(f"{path}/act_scale", None), act=s["act"],
                             real=s["real"])
    return tree.unflatten(flat)
