"""The Pallas product of rows x [M, K] with a weight stored as k-bit codes, read packed and
dequantized in registers: y = x @ ŵᵀ, ŵ [N, K] = code·scale + offset per row and group of
input columns (the layout of jaxllm.lowbit: GPTQ's, round-to-nearest's, GGUF Q4_0/Q4_1/Q8_0's).
No float copy of the weight exists outside the kernel's registers: a decode step reads the
4-bit weight's bytes, half of int8's and an eighth of float32's.

Layout. 2- and 4-bit codes are ``per = 32 / bits`` to a uint32 word, code j of word w being
input column w·per + j; 8-bit codes are bytes (per = 1). Shifting a block of words by j·bits
gives field j, the columns {w·per + j}: the kernel works on the input in this *field-major*
order (:func:`permute`, x as [per, M, K/per]), so unpacking never interleaves (as
pallas_kernels.decode does for packed KV codes). A group of G columns (G a multiple of per,
or one group for the whole input) is then a run of G/per words in every field: a block of
``bw`` words turns into per-word scales and offsets by a select over the few groups it spans,
elementwise (no gather, no reshape), and the ragged last group of 576 = 4 x 128 + 64 needs
nothing special. 3-bit codes (10 to a word, blocks no power of two) have no kernel: the XLA
form (jaxllm.lowbit.matmul) serves them.

Products: per field, x's [bm, bw] block (in the compute dtype) against the dequantized
[bn, bw] block, float32 sums. Grid (M / bm, N / bn, splits): a decode step's few rows split
over K as well (pallas_kernels.rows), so a batch of one fills the GPU. Two lowerings of one
step (``_step``): ``triton`` walks its split's blocks in a loop, the last block moved back to
end at the last word and its repeated words masked (no out-of-bounds read, no padded copy of
the weight); ``tpu`` takes the blocks as the last grid axis. Interpret mode runs both on CPU;
:func:`reference` is the jnp form (whole weight dequantized).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from .rows import TARGET_PROGRAMS, pow2_divisor  # (the split-K kernel's target)

KERNEL_BITS = (2, 4, 8)
MIN_DOT = 16  # the smallest Triton dot dimension


def per_word(bits: int) -> int:
    return 32 // bits if bits in (2, 4) else 1


@dataclasses.dataclass(frozen=True)
class Plan:
    bm: int  # rows per program (padded to a multiple of 16)
    bn: int  # output columns per program
    bw: int  # words per step
    splits: int  # programs over K per (row block, column block)
    num_warps: int = 4
    num_stages: int = 3


MAX_SPAN = 64  # groups one block may touch (each a select over the block): more is XLA's


def supports(bits: int, group: int, K: int, N: int, backend: str = "triton") -> Optional[str]:
    """None when the kernel takes this weight, else why not (its caller then uses the XLA
    form)."""
    per = per_word(bits)
    if bits not in KERNEL_BITS:
        return f"{bits}-bit codes (the kernel reads 2, 4 and 8 bits)"
    if group % per and group < K:
        return f"groups of {group} columns split a word of {per} codes"
    Kw = -(-K // per)
    if backend == "tpu" and N % 128 and N > 2048:
        return f"{N} outputs (TPU blocks: a multiple of 128, or all outputs up to 2,048)"
    if backend != "tpu":
        if Kw < MIN_DOT:
            return f"{K} input columns ({Kw} words, under one block of {MIN_DOT})"
        if not pow2_divisor(N, 128):
            return f"{N} outputs (no power-of-two block of at least {MIN_DOT} divides it)"
    bw = plan_for(1, N, Kw, backend).bw
    if -(-K // group) > 1 and _span(bw, group // per) > MAX_SPAN:
        return f"groups of {group} columns, {_span(bw, group // per)} to a block of {bw} words"
    return None


def _span(bw: int, gw: int) -> int:
    """Groups a block of bw words can touch: from any start, ceil((bw - 1) / gw) + 1."""
    return -(-(bw - 1) // gw) + 1


def plan_for(M: int, N: int, Kw: int, backend: str = "triton") -> Plan:
    """Triton: 16-64 rows, a power-of-two block of N (<= 128) that divides it, 64 words a
    step (or fewer when K is small), and splits of K up to about TARGET_PROGRAMS programs.
    TPU: up to 256 rows (a multiple of 16) in one block, 128 outputs (or all), 128-word steps
    where they divide K, else the whole of K a step."""
    if backend == "tpu":
        bn = 128 if N % 128 == 0 else N
        bw = 128 if Kw % 128 == 0 else Kw
        bm = min(256, -(-M // 16) * 16)
        return Plan(bm, bn, bw, 1)
    bm = min(64, max(16, -(-M // 16) * 16))
    bn = pow2_divisor(N, 128)
    bw = 64 if Kw >= 64 else (32 if Kw >= 32 else 16)
    steps = -(-Kw // bw)
    programs = -(-M // bm) * (N // bn)
    return Plan(bm, bn, bw, max(1, min(steps, -(-TARGET_PROGRAMS // programs))))


def permute(x: Float[Array, "m k"], bits: int) -> Float[Array, "per m kw"]:
    """x [M, K] -> [per, M, K/per] (zero columns to whole words): entry [j, :, w] is column
    w·per + j, the field order the kernel reads codes in."""
    per = per_word(bits)
    M, K = x.shape
    Kw = -(-K // per)
    x = jnp.pad(x, ((0, 0), (0, Kw * per - K)))
    return x.reshape(M, Kw, per).transpose(2, 0, 1)


def _fields(words, bits: int):
    """[bn, bw] stored words or bytes -> the per fields' codes, float32 [bn, bw] each."""
    if bits == 8:
        return [words.astype(jnp.int32).astype(jnp.float32)]
    mask = (1 << bits) - 1
    return [((words >> (bits * j)) & mask).astype(jnp.int32).astype(jnp.float32)
            for j in range(per_word(bits))]


def _per_word(load_col, w0, bw: int, gw: int, n_groups: int, span: int):
    """Scale (or offset) of each of the words [w0, w0 + bw), [bn, bw]: word w is in group
    w // gw; the block spans at most ``span`` groups from w0 // gw. ``load_col(g)`` is the
    [bn, 1] column of group g (clamped into range; a clamped group matches no word)."""
    # lax.div, not //: the operands are non-negative, and floor division's sign correction has
    # no Mosaic TPU lowering off a TPU.
    g0 = jax.lax.div(w0, gw)
    gid = jax.lax.div(w0 + jax.lax.broadcasted_iota(jnp.int32, (1, bw), 1), gw)
    out = None
    for t in range(span):
        g = jnp.minimum(g0 + t, n_groups - 1)
        col = load_col(g).astype(jnp.float32)
        term = jnp.where(gid == g0 + t, col, 0.0)
        out = term if out is None else out + term
    return out


def _step(x_field, words, scale, offset, dtype, bits: int):
    """Sum over the per fields of x's field [bm, bw] times the field's dequantized weight
    [bn, bw] transposed: [bm, bn] float32."""
    acc = None
    for j, c in enumerate(_fields(words, bits)):
        w = (c * scale + offset).astype(dtype)
        y = jax.lax.dot_general(x_field(j), w, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        acc = y if acc is None else acc + y
    return acc


@dataclasses.dataclass(frozen=True)
class _Spec:
    bits: int
    Kw: int
    gw: int  # words per group (Kw for one group)
    n_groups: int
    plan: Plan
    dtype: object

    @property
    def span(self) -> int:
        return min(self.n_groups, _span(self.plan.bw, self.gw))


def _triton_kernel(x_ref, w_ref, s_ref, o_ref, out_ref, *, spec: _Spec):
    p = spec.plan
    nsteps = -(-spec.Kw // p.bw)
    per_split = -(-nsteps // p.splits)
    split = pl.program_id(2)
    first = split * per_split
    n = jnp.clip(nsteps - first, 0, per_split)

    def body(i, acc):
        nominal = (first + i) * p.bw
        w0 = jnp.minimum(nominal, spec.Kw - p.bw)  # the last block ends at the last word
        cols = pl.ds(w0, p.bw)
        keep = (w0 + jax.lax.broadcasted_iota(jnp.int32, (1, p.bw), 1)) >= nominal

        def x_field(j):
            return jnp.where(keep, x_ref[j, :, cols], 0).astype(spec.dtype)

        def col(ref):
            return lambda g: ref[:, pl.ds(g, 1)]
        sc = _per_word(col(s_ref), w0, p.bw, spec.gw, spec.n_groups, spec.span)
        of = _per_word(col(o_ref), w0, p.bw, spec.gw, spec.n_groups, spec.span)
        return acc + _step(x_field, w_ref[:, cols], sc, of, spec.dtype, spec.bits)

    out_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros(out_ref.shape, jnp.float32))


def _tpu_kernel(x_ref, w_ref, s_ref, o_ref, out_ref, *, spec: _Spec):
    p = spec.plan
    k = pl.program_id(2)
    w0 = k * p.bw

    @pl.when(k == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    def col(ref):
        return lambda g: ref[:, pl.ds(g, 1)]
    sc = _per_word(col(s_ref), w0, p.bw, spec.gw, spec.n_groups, spec.span)
    of = _per_word(col(o_ref), w0, p.bw, spec.gw, spec.n_groups, spec.span)
    out_ref[...] += _step(lambda j: x_ref[j].astype(spec.dtype), w_ref[...], sc, of,
                          spec.dtype, spec.bits)


@functools.partial(jax.jit, static_argnames=("bits", "group", "in_features", "dtype",
                                             "backend", "plan", "interpret"))
def lowbit_matmul(x: Float[Array, "m k"], codes: Array, scale: Float[Array, "n g"],
                  offset: Float[Array, "n g"], *, bits: int, group: int, in_features: int,
                  dtype=jnp.bfloat16, backend: str = "triton", plan: Optional[Plan] = None,
                  interpret: bool = False) -> Float[Array, "m n"]:
    """y [M, N] = x [M, K] @ ŵᵀ, float32, for codes [N, K/per] uint32 (2, 4 bits) or [N, K]
    uint8 (8 bits), scale and offset [N, groups]: x and ŵ rounded to ``dtype`` (the model's
    compute dtype), products summed in float32. ``backend``: ``triton`` or ``tpu``."""
    M, K = x.shape
    N = codes.shape[0]
    why = supports(bits, group, K, N, backend)
    if why is not None or K != in_features:
        raise ValueError(f"lowbit_matmul cannot take this weight: "
                         f"{why or f'x has {K} columns, the weight {in_features}'}")
    per = per_word(bits)
    Kw = codes.shape[1]
    n_groups = scale.shape[1]
    gw = Kw if n_groups == 1 else group // per
    p = plan or plan_for(M, N, Kw, backend)
    spec = _Spec(bits, Kw, gw, n_groups, p, jnp.dtype(dtype))
    Mp = -(-M // p.bm) * p.bm
    xp = permute(jnp.pad(x, ((0, Mp - M), (0, 0))), bits)  # [per, Mp, Kw]
    grid_mn = (Mp // p.bm, N // p.bn)
    cost = pl.CostEstimate(flops=2 * Mp * N * Kw * per, transcendentals=0,
                           bytes_accessed=codes.size * codes.dtype.itemsize
                           + 4 * (xp.size + 2 * scale.size + p.splits * Mp * N))
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        out = pl.pallas_call(
            functools.partial(_tpu_kernel, spec=spec),
            grid=(*grid_mn, Kw // p.bw),
            in_specs=[pl.BlockSpec((per, p.bm, p.bw), lambda i, j, k: (0, i, k)),
                      pl.BlockSpec((p.bn, p.bw), lambda i, j, k: (j, k)),
                      pl.BlockSpec((p.bn, n_groups), lambda i, j, k: (j, 0)),
                      pl.BlockSpec((p.bn, n_groups), lambda i, j, k: (j, 0))],
            out_specs=pl.BlockSpec((p.bm, p.bn), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
            interpret=interpret, cost_estimate=cost,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
        )(xp, codes, scale, offset)
        return out[:M]
    from jax.experimental.pallas import triton as pl_triton
    parts = pl.pallas_call(
        functools.partial(_triton_kernel, spec=spec),
        grid=(*grid_mn, p.splits),
        in_specs=[pl.BlockSpec((per, p.bm, Kw), lambda i, j, s: (0, i, 0)),
                  pl.BlockSpec((p.bn, Kw), lambda i, j, s: (j, 0)),
                  pl.BlockSpec((p.bn, n_groups), lambda i, j, s: (j, 0)),
                  pl.BlockSpec((p.bn, n_groups), lambda i, j, s: (j, 0))],
        out_specs=pl.BlockSpec((None, p.bm, p.bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((p.splits, Mp, N), jnp.float32),
        interpret=interpret, cost_estimate=cost,
        compiler_params=pl_triton.CompilerParams(num_warps=p.num_warps,
                                                 num_stages=p.num_stages),
    )(xp, codes, scale, offset)
    return jnp.sum(parts, axis=0)[:M]


def reference(x, codes, scale, offset, *, bits: int, group: int, in_features: int,
              dtype=jnp.bfloat16) -> Float[Array, "m n"]:
    """:func:`lowbit_matmul` in jnp: the whole weight unpacked and dequantized in float32,
    rounded to ``dtype`` with x, the product summed in float32 at full precision."""
    per = per_word(bits)
    N = codes.shape[0]
    if bits == 8:
        c = codes.astype(jnp.float32)
    else:
        shifts = bits * jnp.arange(per, dtype=jnp.uint32)
        c = ((codes[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)).reshape(N, -1)
        c = c[:, :in_features].astype(jnp.float32)
    g = jnp.arange(in_features) // group
    w = c * scale.astype(jnp.float32)[:, g] + offset.astype(jnp.float32)[:, g]
    return jnp.einsum("mk,nk->mn", x.astype(dtype).astype(jnp.float32),
                      w.astype(dtype).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
