"""bfloat16 kept as its 16-bit patterns (uint16) and narrow arrays widened to float32 a few rows
at a time: what a CPU needs to read 2-byte caches and weights without a float32 copy of the
whole array (why: docs/CPU.md, "bfloat16 on a CPU")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt16


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
    whole array into new memory (docs/CPU.md, "bfloat16 on a CPU"). Exact either way: the same
    float32 products of the same widened values (when the group size does not divide the rows,
    the last group overlaps the one before and writes the same values again)."""
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
