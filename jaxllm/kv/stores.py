"""The KV cache's storage formats behind one protocol, so attention never asks which one it
holds. Every format answers:

* ``read(lay)``: the layer's keys or values [B, n, C, h] as attention reads them (float);
* ``stored(chunk)``: a chunk [B, n, T, h] exactly as the format returns it once written (its
  dtype, its quantization), so a chunk attends to its own tokens as token-by-token would;
* ``write(chunk, lay, scatter)``: the format after the chunk is written; ``scatter(array,
  rows)`` places the rows (the ring's slots, jaxllm.kv.cache.write_chunk, or score-based
  eviction's free slot);
* ``select(chunk, idx)``: the format holding, in slot i, entry ``idx`` of [slots | chunk]
  (score-based compression).

Formats: :class:`FloatStore` (a float array; the cache keeps the bare array, this wraps it for
the protocol), :class:`Bf16Bits` (a bfloat16 cache on CPU), and jaxllm.kv.quantized's int8,
k-bit and KIVI stores. The module functions below take a layer as the cache holds it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, UInt16

from ..bits import to_bits
from .quantized import round_to


class FloatStore:
    """A float array (float32, bfloat16, float16) as a store."""

    def __init__(self, array: Float[Array, "b n c h"]):
        self.array = array

    def read(self, lay=None) -> Float[Array, "b n c h"]:
        return self.array

    def stored(self, chunk: Float[Array, "b n t h"]) -> Float[Array, "b n t h"]:
        """A bfloat16 rounding goes through quantized.round_to, which XLA:GPU keeps (it
        removes a bare convert pair); float16 keeps astype, since round_to would flush the
        subnormals its write keeps (so on a GPU a float16 chunk may attend to its own keys
        unrounded)."""
        dt = self.array.dtype
        return (round_to(chunk, dt) if dt == jnp.bfloat16 else chunk).astype(dt)

    def write(self, chunk: Float[Array, "b n t h"], lay, scatter) -> Float[Array, "b n c h"]:
        return scatter(self.array, chunk)

    def select(self, chunk: Float[Array, "b n t h"], idx: Int[Array, "b n c"]
               ) -> Float[Array, "b n c h"]:
        both = jnp.concatenate([self.array, chunk.astype(self.array.dtype)], axis=2)
        return jnp.take_along_axis(both, idx[..., None], axis=2)


@struct.dataclass
class Bf16Bits:
    """A layer of a bfloat16 cache on CPU: its keys or values [B, n, C, h] kept as their 16-bit
    patterns (uint16). :func:`init_cache` stores a bfloat16 cache this way on CPU; on other
    backends a bfloat16 cache is a plain bfloat16 array.

    Why (XLA:CPU widens every bfloat16 operand whole, and leaves integer arrays alone):
    docs/CPU.md, "bfloat16 on a CPU".

    To everything else it is a store (kvquant's interface): ``read`` gives the bfloat16 array
    and ``stored`` rounds a chunk to bfloat16, so a bits cache and a bfloat16 array attend to
    and keep the same numbers.
    """

    bits: UInt16[Array, "b n c h"]

    @property
    def shape(self) -> tuple:
        return self.bits.shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    def read(self, lay=None) -> Float[Array, "b n c h"]:
        return jax.lax.bitcast_convert_type(self.bits, jnp.bfloat16)

    def stored(self, chunk: Float[Array, "b n t h"]) -> Float[Array, "b n t h"]:
        return chunk.astype(jnp.bfloat16)

    def write(self, chunk: Float[Array, "b n t h"], lay, scatter) -> "Bf16Bits":
        return self.replace(bits=scatter(self.bits, to_bits(chunk)))

    def select(self, chunk: Float[Array, "b n t h"], idx: Int[Array, "b n c"]) -> "Bf16Bits":
        both = jnp.concatenate([self.bits, to_bits(chunk)], axis=2)
        return self.replace(bits=jnp.take_along_axis(both, idx[..., None], axis=2))


def store(layer_kv):
    """The protocol's object for a layer as the cache holds it."""
    return FloatStore(layer_kv) if isinstance(layer_kv, jax.Array) else layer_kv


def read(layer_kv, lay) -> Float[Array, "b n c h"]:
    """A layer's keys or values as attention reads them: the float array, or a store decoded
    (a quantized store's sink slots, and KIVI's residual, in full precision)."""
    return store(layer_kv).read(lay)


def as_stored(layer_kv, chunk: Float[Array, "b n t h"]) -> Float[Array, "b n t h"]:
    """``chunk`` exactly as the layer will return it once written."""
    return store(layer_kv).stored(chunk)


def write(layer_kv, chunk: Float[Array, "b n t h"], lay, scatter):
    """The layer after ``chunk`` is written, ``scatter(array, rows)`` placing its rows."""
    return store(layer_kv).write(chunk, lay, scatter)


def select(layer_kv, chunk: Float[Array, "b n t h"], idx: Int[Array, "b n c"]):
    """The layer holding, in slot i of each row and head, entry ``idx`` of [its slots | the
    chunk's tokens] (score-based compression, jaxllm.kv.evict.compress)."""
    return store(layer_kv).select(chunk, idx)


def slots(layer_kv):
    """A layer as the stored-format decode kernel reads it (pallas_kernels.decode):
    ``(Layout, arrays [B·n, C, ...])``, or None for a store it cannot read. A bfloat16 cache's
    bits (on CPU, where the kernel only runs interpreted, in tests) are viewed as bfloat16."""
    from pallas_kernels.decode import Layout
    if isinstance(layer_kv, Bf16Bits):
        layer_kv = layer_kv.read()
    if isinstance(layer_kv, jax.Array):
        return Layout("float"), (layer_kv.reshape((-1,) + layer_kv.shape[2:]),)
    view = getattr(layer_kv, "slots", None)
    return view() if view is not None else None


def sinks(layer_kv, S: int) -> Float[Array, "b n s h"]:
    """The layer's first ``S`` slots in full precision: a float cache's own slots, a quantized
    store's full-precision copy of them."""
    if isinstance(layer_kv, Bf16Bits):
        layer_kv = layer_kv.read()
    if isinstance(layer_kv, jax.Array):
        return layer_kv[:, :, :S]
    return layer_kv.sinks


def raw(layer_kv, lay):
    """A layer as a blockwise reader takes it, a block at a time (jaxllm.attention.flash's
    Segment): Bf16Bits as its uint16 bits (never widened whole), a quantized store decoded, a
    float array as it is."""
    return layer_kv.bits if isinstance(layer_kv, Bf16Bits) else read(layer_kv, lay)


def holding(layer_kv, arr):
    """``layer_kv`` holding ``arr``, what :func:`raw` gave for it after a loop carried it
    through; a quantized store's raw form is a decoded copy, so the store stays as it is."""
    if isinstance(layer_kv, Bf16Bits):
        return layer_kv.replace(bits=arr)
    return arr if isinstance(layer_kv, jax.Array) else layer_kv
