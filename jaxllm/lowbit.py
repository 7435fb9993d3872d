"""Weight-only low-bit linears: k-bit codes with a scale and a float offset per row and group of
input columns, ŵ = code·scale + offset, the layout GPTQ and round-to-nearest write
(jaxllm.gptq). GPTQ's zero point is stored as offset = -scale·zero ("GPTQ", Frantar et al. 2023,
the authors' quantizer: ŵ = scale·(code - zero)); GGUF's Q4_1 float minimum is an offset too.

Codes are K-major like jaxllm.quant.QKernel ([out, in], the transpose of a float kernel) and
packed along the input, per = 32 // bits codes to a uint32 word (2 bits: 16, 3 bits: 10 in 30
of its bits, 4 bits: 8), code j of word w being column w·per + j (the input padded with zero
codes to whole words: 576 columns are 58 words of 3-bit codes, the last holding 6); 8-bit codes
one per byte. Group g covers input columns [g·G, (g+1)·G); a group
size that does not divide the input width leaves a shorter last group (128 into 576: four of
128 and one of 64). Scales and offsets are float32, exactly what GPTQ's quantizer used, or
float16 where that is exact (a GGUF file's).

A linear holding a :class:`QLowBit` multiplies without a float copy of the model's weights
(:func:`matmul`): on GPU and TPU a Pallas kernel dequantizes in registers; XLA's form (CPU)
dequantizes one layer's weight, or a chunk of it, at a time inside the compiled step.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float

import pallas_kernels
from pallas_kernels import cpu as cpu_kernels
from pallas_kernels import packed_matmul as kernel
from pallas_kernels.reference import after

BITS = (2, 3, 4, 8)
PACKED = (2, 3, 4)
# How a node's products take their input: ``none``, x as it is (float); ``block``, x rounded to
# 8 bits per 32 columns first (:func:`round_blocks`), as llama.cpp multiplies its blocks (Q4_0,
# Q4_1, Q8_0): on a CPU the C++ kernel then multiplies integers (docs/CPU.md, "Low-bit
# products").
ACTS = ("none", "block")
BLOCK = 32  # input columns per 8-bit scale of ``block``


def pack(codes, bits: int):
    """uint8 codes [..., n] -> uint32 [..., ceil(n / per)], per = 32 // bits (numpy in, numpy
    out: a loader packs on the host, without a compiled program per weight shape)."""
    per = 32 // bits
    if isinstance(codes, np.ndarray):
        n = codes.shape[-1]
        c = np.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, -n % per)]).astype(np.uint32)
        c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
        return np.bitwise_or.reduce(c << (bits * np.arange(per, dtype=np.uint32)), axis=-1)
    n = codes.shape[-1]
    c = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, -n % per)]).astype(jnp.uint32)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    shifts = bits * jnp.arange(per, dtype=jnp.uint32)
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32)  # fields do not overlap: sum = or


def unpack(words, bits: int, n: int):
    """Inverse of :func:`pack`: uint32 [..., ceil(n / per)] -> uint8 codes [..., n]."""
    per = 32 // bits
    shifts = bits * jnp.arange(per, dtype=jnp.uint32)
    c = (words[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], words.shape[-1] * per)[..., :n].astype(jnp.uint8)


@struct.dataclass
class QLowBit:
    """A weight-only k-bit linear [out, in]: ``codes`` [out, ceil(in / per)] uint32 (2, 3, 4
    bits) or [out, in] uint8 (8 bits); ``scale``, ``offset`` [out, groups] float32 (or
    float16)."""

    codes: Array
    scale: Array
    offset: Array
    bits: int = struct.field(pytree_node=False)
    group: int = struct.field(pytree_node=False)  # input columns per group (in: per channel)
    in_features: int = struct.field(pytree_node=False)
    act: str = struct.field(pytree_node=False, default="none")  # ACTS

    @property
    def shape(self) -> tuple:
        return (self.codes.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.codes, self.scale, self.offset))

    def rows(self, idx) -> "QLowBit":
        """The node holding output rows ``idx`` only."""
        return self.replace(codes=self.codes[idx], scale=self.scale[idx],
                            offset=self.offset[idx])

    # What a model asks of a quantized weight (jaxllm.quant.QKernel answers the same).
    def matmul(self, x: Float[Array, "... i"], dtype, backend: str = "auto"
               ) -> Float[Array, "... o"]:
        """x @ ŵᵀ (:func:`matmul`)."""
        return matmul(x, self, dtype, backend)

    def lookup(self, tokens: Array) -> Float[Array, "... d"]:
        """An embedding table's rows for ``tokens``, only those dequantized."""
        rows = dequantize(self.rows(tokens.reshape(-1)))
        return rows.reshape(*tokens.shape, self.in_features)

    def head(self, x: Float[Array, "... d"], vocab: int, backend: str = "auto"
             ) -> Float[Array, "... v"]:
        """A tied head over the table's first ``vocab`` rows."""
        table = self if self.codes.shape[0] == vocab else self.rows(slice(None, vocab))
        return matmul(x, table, jnp.float32, backend)


def round_blocks(x: Float[Array, "... i"]) -> Float[Array, "... i"]:
    """x rounded to 8 bits per BLOCK columns (the last block shorter): d = max|x| · (1/127) over
    the block, x̂ = round(x / d) · d, round half to even (0 where the block is all zeros);
    float32. The C++ kernel's rounding (``int8_x``), to the bit."""
    x = x.astype(jnp.float32)
    n = x.shape[-1]
    pad = -n % BLOCK
    xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, BLOCK)
    d = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) * np.float32(1 / 127)
    q = jnp.where(d > 0, jnp.clip(jnp.round(xb / jnp.where(d > 0, d, 1)), -127, 127), 0)
    return (q * d).reshape(*x.shape[:-1], -1)[..., :n]


def round_inputs(params) -> dict:
    """``params`` with every 4- and 8-bit node whose groups are whole blocks of BLOCK columns
    taking its input rounded to 8 bits (``act="block"``): on a CPU the kernel then multiplies
    integers, llama.cpp's arithmetic for its Q4_0 / Q4_1 / Q8_0 blocks (faster there, the
    products off by that rounding). Other nodes (2- and 3-bit codes, other group sizes) keep
    float inputs. An embedding table's lookups are unchanged; as a tied head it is a product."""
    kinds = lambda v: isinstance(v, QLowBit)  # noqa: E731
    hit = []

    def one(v):
        if kinds(v) and v.bits in (4, 8) and v.group % BLOCK == 0:
            hit.append(v)
            return v.replace(act="block")
        return v
    out = jax.tree.map(one, params, is_leaf=kinds)
    if not hit:
        raise ValueError(f"no 4- or 8-bit weights in groups of a multiple of {BLOCK} columns "
                         f"here: rounding inputs applies to them (load a GGUF file's Q4_0 / "
                         f"Q4_1 / Q8_0 blocks with keep_quantized=True, or quantize with a "
                         f"group of 32k)")
    return out


def check(bits: int, group: int, in_features: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits {bits} is not supported; choose one of "
                         f"{', '.join(map(str, BITS))}")
    if group < 1:
        raise ValueError(f"group must be >= 1 input columns (the input width for per-channel), "
                         f"got {group}")


def n_groups(group: int, in_features: int) -> int:
    return -(-in_features // group)


def expand(per_group: Float[Array, "o g"], group: int, in_features: int) -> Float[Array, "o i"]:
    """[out, groups] -> [out, in]: each group's value over its columns (the last one ragged)."""
    return jnp.repeat(per_group, group, axis=1, total_repeat_length=n_groups(
        group, in_features) * group)[:, :in_features]


def encode(codes, scale, offset, bits: int, group: int) -> QLowBit:
    """A node from integer codes [out, in] (0..2^bits - 1) and per-group scale, offset (kept
    float16 when given so, e.g. a GGUF file's exact float16 scales; float32 otherwise)."""
    out, in_features = codes.shape
    check(bits, group, in_features)
    c = codes.astype(np.uint8) if isinstance(codes, np.ndarray) else \
        jnp.asarray(codes).astype(jnp.uint8)
    keep = lambda a: jnp.asarray(a, jnp.float16 if jnp.asarray(a).dtype == jnp.float16  # noqa
                                 else jnp.float32)
    return QLowBit(jnp.asarray(pack(c, bits) if bits in PACKED else c), keep(scale),
                   keep(offset), bits=bits, group=group, in_features=in_features)


def codes_of(node: QLowBit) -> Array:
    """The integer codes [out, in] (uint8)."""
    if node.bits in PACKED:
        return unpack(node.codes, node.bits, node.in_features)
    return node.codes


def dequantize(node: QLowBit, dtype=jnp.float32) -> Float[Array, "o i"]:
    """ŵ = code·scale + offset, [out, in] (the K-major weight)."""
    c = codes_of(node).astype(jnp.float32)
    w = c * expand(node.scale.astype(jnp.float32), node.group, node.in_features) + \
        expand(node.offset.astype(jnp.float32), node.group, node.in_features)
    return w.astype(dtype)


# A weight of at most this many elements is dequantized whole (16 MiB of float32; a small
# model's every linear): one product instead of a loop, which compiles in a fraction of the time.
WHOLE_ELEMENTS = 1 << 22


def chunk_columns(node: QLowBit) -> int:
    """Input columns per step of :func:`matmul`: whole words and whole groups, at least 128
    (the input width when it is smaller, or the weight small: WHOLE_ELEMENTS)."""
    if node.codes.shape[0] * node.in_features <= WHOLE_ELEMENTS:
        return node.in_features
    per = 32 // node.bits if node.bits in PACKED else 1
    c = np.lcm(node.group, per)
    c *= -(-128 // c)
    return int(c) if c < node.in_features else node.in_features


def matmul(x: Float[Array, "... i"], node: QLowBit, dtype=jnp.float32, backend: str = "auto"
           ) -> Float[Array, "... o"]:
    """x @ ŵᵀ in ``dtype``. On a GPU or TPU the Pallas kernel (pallas_kernels.packed_matmul)
    reads the packed codes and dequantizes in registers, x and ŵ rounded to ``dtype``, float32
    sums; weights it does not take (3-bit codes, shapes in its ``supports``) use
    :func:`xla_matmul`. On a CPU with AVX2, a few rows (decode) of 4- or 8-bit codes go to the
    C++ kernel that widens the codes in registers (pallas_kernels.cpu.lowbit_rows); more rows,
    and other CPUs, use :func:`xla_matmul`. ``backend="xla"`` (a ModelConfig's
    ``kernels.int8``) chooses the XLA form everywhere, ``"cpu"`` the C++ kernel on a CPU and
    the XLA form on any other platform (the Pallas kernels are then never traced). A node with ``act="block"``
    (:func:`round_inputs`) multiplies x rounded to 8 bits per 32 columns on every path; the
    CPU kernel then multiplies integers."""
    lead, n = x.shape[:-1], node.in_features
    out = node.codes.shape[0]
    x2 = x.reshape(-1, n)
    if node.act not in ACTS:
        raise ValueError(f"unknown input rounding act={node.act!r}; choose one of {ACTS}")
    rounded = node.act == "block"
    # The kernel rounds x itself and multiplies integers where it can; every other path
    # multiplies the rounded x in float.
    int8_x = rounded and node.bits in (4, 8) and node.group % BLOCK == 0
    rx = (lambda x2: round_blocks(x2.astype(dtype))) if rounded else (lambda x2: x2)

    def xla(x2):
        return xla_matmul(x2, node, dtype)

    def by(backend):
        if kernel.supports(node.bits, node.group, n, out, backend) is not None:
            return xla
        return lambda x2: kernel.lowbit_matmul(
            rx(x2), node.codes, node.scale, node.offset, bits=node.bits, group=node.group,
            in_features=n, dtype=dtype, backend=backend).astype(dtype)
    def on_cpu(x2):
        x2 = x2.astype(dtype).astype(jnp.float32)
        return cpu_kernels.lowbit_rows(x2 if int8_x else rx(x2), node.codes, node.scale,
                                       node.offset, node.bits, node.group,
                                       int8_x=int8_x).astype(dtype)
    cpu = on_cpu if cpu_kernels.lowbit_use_for(x2.shape[0], node.bits, node.group) else xla
    if pallas_kernels.resolve_backend(backend) == "xla":
        y = xla(x2)
    elif backend == "cpu":  # chosen: the C++ kernel on a CPU, XLA's form elsewhere; no Pallas
        y = cpu_kernels.on_cpu(cpu, xla, x2)  # kernel traced (a second a program for SmolLM2)
    else:
        y = jax.lax.platform_dependent(x2, cuda=by("triton"), rocm=by("triton"),
                                       tpu=by("tpu"), cpu=cpu, default=xla)
    return y.reshape(*lead, out)


def xla_matmul(x: Float[Array, "... i"], node: QLowBit, dtype=jnp.float32
               ) -> Float[Array, "... o"]:
    """x @ ŵᵀ, products in float32, the result in ``dtype``. A large weight is dequantized a
    chunk of input columns at a time inside a loop (:func:`chunk_columns`), so no float copy of
    it is ever whole, and a compiled program cannot hold every layer's at once
    (docs/KERNELS.md, "Low-bit weights"). Columns past the last whole chunk (whole words and
    groups from its start) are a last, shorter step. A node with ``act="block"`` multiplies x
    rounded (:func:`round_blocks`)."""
    lead, n = x.shape[:-1], node.in_features
    xf = x.astype(dtype).astype(jnp.float32).reshape(-1, n)
    if node.act == "block":
        xf = round_blocks(xf.astype(dtype))
    C = chunk_columns(node)
    per = 32 // node.bits if node.bits in PACKED else 1
    out = node.codes.shape[0]

    def part(words, sc, of, xc):  # the product over some columns, from their stored form
        width = xc.shape[1]
        codes = unpack(words, node.bits, width) if node.bits in PACKED else words
        w = codes.astype(jnp.float32) * expand(sc.astype(jnp.float32), node.group, width) + \
            expand(of.astype(jnp.float32), node.group, width)  # [out, width]
        w = after(xc, w)  # dequantized as the layer runs, not all layers' at the start
        return jnp.einsum("mc,oc->mo", xc, w, preferred_element_type=jnp.float32)

    full = n // C if C < n else 0
    y = jnp.zeros((xf.shape[0], out), jnp.float32)
    if full:
        def step(y, i):
            sl = lambda a, start, size: jax.lax.dynamic_slice_in_dim(a, start, size, 1)  # noqa
            return y + part(sl(node.codes, i * (C // per), C // per),
                            sl(node.scale, i * (C // node.group), C // node.group),
                            sl(node.offset, i * (C // node.group), C // node.group),
                            sl(xf, i * C, C)), None
        y, _ = jax.lax.scan(step, y, jnp.arange(full))
    if full * C < n:  # the rest (all of it when C == n), from a whole word and group
        s = full * C
        y = y + part(node.codes[:, s // per:], node.scale[:, s // node.group:],
                     node.offset[:, s // node.group:], xf[:, s:])
    return y.reshape(*lead, out).astype(dtype)


def numpy_dequantize(node: QLowBit) -> np.ndarray:
    """:func:`dequantize` in numpy float64 (reports, tests of this module's users)."""
    return np.asarray(jax.device_get(dequantize(node)), np.float64)
