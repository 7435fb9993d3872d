"""INT8 tensors and matmuls (SmoothQuant, Xiao et al. 2023, §2 and docs/METHODS.md §3).

Symmetric quantization: Δ = max|X| / 127, X̄ = clip(round(X / Δ), -127, 127). An INT8 GEMM can
only rescale along its outer dimensions, Y = diag(Δ_X) (X̄ W̄) diag(Δ_W) (eq. 2), so activation
scales are per token (rows) or per tensor, and weight scales per output channel or per tensor.

A quantized weight is a :class:`QKernel` pytree node in place of the float ``kernel`` leaf: the
int8 values and their scale are ordinary leaves, and how activations are quantized is static
metadata of the node, so ``jit`` specialises on it and ``forward``/``generate`` take quantized
params unchanged. ``Linear`` (and the embedding) dispatch on the node type.

Weight-only products (W8 and the float layouts :func:`decode_weights` makes) are
jaxllm.weight_only; bfloat16 kept as its bits, widened a few rows at a time, jaxllm.bits.
"""
from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, Int8

import pallas_kernels
from pallas_kernels.reference import QMAX

from . import pages, tree
from .weight_only import weight_only_matmul

ACT_MODES = ("token", "tensor", "static", "none")


@struct.dataclass
class QKernel:
    """An int8 weight ``q`` [out, in] with ``scale`` [out] (per channel) or [] (per tensor); or a
    float weight kept [out, in] for decoding (float32/bfloat16/float16 ``q``, scale 1,
    ``act="none"``: :func:`decode_weights`).

    ``q`` is stored K-major ([out, in], the transpose of the float kernel): the layout int8 GEMMs
    want (Hopper's wgmma requires it; XLA:CPU runs it faster than [in, out]: docs/CPU.md).

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

    # What a model asks of a quantized weight (jaxllm.lowbit.QLowBit answers the same).
    def matmul(self, x: Float[Array, "... i"], dtype, backend: str = "auto"
               ) -> Float[Array, "... o"]:
        """x @ W (:func:`qmatmul`)."""
        return qmatmul(x, self, dtype, backend)

    def lookup(self, tokens: Int[Array, "..."]) -> Float[Array, "... d"]:
        """An embedding table's rows for ``tokens``: int8 rows times their scales."""
        return self.q[tokens].astype(jnp.float32) * self.scale[tokens][..., None]

    def head(self, x: Float[Array, "... d"], vocab: int, backend: str = "auto"
             ) -> Float[Array, "... v"]:
        """A tied head over the table's first ``vocab`` rows (the table is [vocab, dim] =
        [out, in])."""
        return qmatmul(x, self.replace(q=self.q[:vocab], scale=self.scale[:vocab]),
                       jnp.float32, backend)


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


def quantized_nodes() -> tuple:
    """The node types of quantized or decode-layout weights: what "already quantized" means
    to every converter (int8 and weight-only QKernel, INT8 attention's QAttention, low-bit
    QLowBit)."""
    from .lowbit import QLowBit  # (lowbit builds on this module)
    return QKernel, QAttention, QLowBit


def is_quantized(params) -> bool:
    """Whether any weight is quantized, or stored in a decode layout, already."""
    kinds = quantized_nodes()
    return any(isinstance(x, kinds) for x in
               jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, kinds)))


def decode_weights(params, dtype: str = "bfloat16") -> dict:
    """Float params with every linear kernel and the embedding table stored [out, in] in
    ``dtype`` (float32, bfloat16 or float16), as weight-only nodes: a :class:`QKernel` with ``q``
    the weight [out, in], a scale of 1 and ``act="none"``. Norms, biases and position tables
    stay float32. The layout for decoding on a CPU; training and converters take the plain
    params.

    Why this layout on a CPU, with its measurements: docs/CPU.md, "Weights for decoding".
    Products run in float32 on CPU (in the config's dtype elsewhere); ``forward``/``generate``
    take the result unchanged, and ``jaxllm.io.save_model`` writes it (as ``q``/``scale``
    pairs). On a CPU the new arrays are moved onto 2 MiB pages (:mod:`jaxllm.pages`), which a
    decode step reads faster.
    """
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"decode_weights stores float32, bfloat16 or float16 weights, got "
                         f"{dtype!r} (int8 weights: jaxllm.smoothquant.quantize)")
    if is_quantized(params):
        raise ValueError("these weights are quantized (or in a decode layout) already; "
                         "convert the float model")
    flat = tree.flatten(params)
    dt = jnp.dtype(dtype)
    out = {}
    for path, x in flat.items():
        if path.endswith("/kernel"):  # [in, out] -> [out, in], one scale for the tensor
            x = QKernel(jnp.asarray(x).T.astype(dt), jnp.ones((), jnp.float32), act="none")
        elif path == "embed/embedding":  # already [vocab, dim] = [out, in] as a tied head
            x = QKernel(jnp.asarray(x).astype(dt), jnp.ones(x.shape[:1], jnp.float32),
                        act="none")
        out[path] = x
    return pages.on_huge_pages(tree.unflatten(out), keep=params)


def half_weights(params, dtype: str = "bfloat16") -> dict:
    """:func:`decode_weights` in a 2-byte ``dtype`` (bfloat16 or float16): half float32's bytes.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half_weights stores bfloat16 or float16 weights, got {dtype!r}")
    return decode_weights(params, dtype)


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


def qmatmul(x: Float[Array, "... i"], k: QKernel, dtype=jnp.float32, backend: str = "auto"
            ) -> Float[Array, "... o"]:
    """x @ W for a quantized W (stored [out, in]), by the node's activation mode and real/fake
    setting. Scales are per output channel or per tensor. ``backend``: the INT8 products'
    implementation (pallas_kernels.resolve_backend; a ModelConfig's ``kernels.int8``)."""
    if k.act == "none":  # weight-only: the int8 (or half) weight is widened next to the matmul
        return weight_only_matmul(x, k.q, k.scale, dtype, backend)
    if k.q.dtype != jnp.int8:
        raise ValueError(f"a {k.q.dtype.name} weight is weight-only (act='none'); act={k.act!r} "
                         f"needs int8 weights (jaxllm.smoothquant.quantize)")
    lead = x.shape[:-1]
    if k.real and k.act == "token":  # the rows' quantization goes with the product (a CPU
        # kernel does both in one call at few rows; the numbers of the branch below under jit)
        y = pallas_kernels.w8a8_matmul_per_token(x.reshape(-1, x.shape[-1]), k.q, k.scale,
                                                 backend=backend)
        return y.reshape(*lead, k.q.shape[0]).astype(dtype)
    sx = act_scale_of(x, k)
    xq = quantize(x, sx)
    if k.real:  # eq. 2: the scales are applied to the int32 product (outer dims only)
        # pallas_kernels dispatches: the Pallas kernel on GPU/TPU, XLA's dot_general elsewhere.
        y = pallas_kernels.w8a8_matmul(xq.reshape(-1, x.shape[-1]), k.q, sx, k.scale,
                                       backend=backend)
        return y.reshape(*lead, k.q.shape[0]).astype(dtype)
    # Fake quant: the same quantize-dequantize, multiplied in float32. The integer-valued product
    # is formed first (exact in float32 while |sum| < 2^24) and scaled after, as eq. 2 does, so
    # real and fake modes differ only by float rounding.
    acc = jnp.einsum("...i,oi->...o", xq.astype(jnp.float32), k.q.astype(jnp.float32))
    return (acc * sx * k.scale).astype(dtype)


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
                          "in_features": node.in_features, "act": node.act}
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
        if s.get("kind") == "attention":
            flat[path] = QAttention(real=s["real"])
            continue
        if s.get("kind") == "lowbit":
            from .lowbit import QLowBit
            flat[path] = QLowBit(*(flat.pop(f"{path}/{n}") for n in ("codes", "scale", "offset")),
                                 bits=s["bits"], group=s["group"], in_features=s["in_features"],
                                 act=s.get("act", "none"))
            continue
        q, scale = flat.pop(f"{path}/q"), flat.pop(f"{path}/scale")
        flat[path] = QKernel(q, scale, flat.pop(f"{path}/act_scale", None), act=s["act"],
                             real=s["real"])
    return tree.unflatten(flat)
