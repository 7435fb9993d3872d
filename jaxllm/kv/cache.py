"""The attention-sink KV cache (StreamingLLM, Xiao et al. 2023, §3.2) as a fixed-shape pytree.

One cache type serves every policy; its kind (jaxllm.kinds, a static field) says which:

* **StreamingLLM** ``S > 0``: the first ``S`` tokens of the stream stay forever in slots
  ``0..S-1``; later tokens go round a ring of ``W`` slots. Token ``t`` is written to slot ``t`` if
  ``t < S`` else ``S + (t - S) mod W``.
* **window** ``S = 0``: the ring alone.
* **dense** ``S = 0, W = max length, ring=False``: nothing is ever evicted; writing past the end
  is an error.
* **H2O / Q-Hitter** (jaxllm.kinds.Scored, jaxllm.kv.evict): ``S`` sinks plus ``H + R + 1`` slots whose
  tokens are chosen by accumulated attention (and quantization error); per-slot scores and
  positions ride along in ``state``. The ring arithmetic below does not apply to them.

Semantics (the authors' ``eval_long_ppl.py``, docs/METHODS.md §1): token ``t`` attends to the sinks
``0..S-1`` and to tokens ``t-W+1..t``, exactly as if the cache were trimmed to ``S + W`` after every
token. **Positions are assigned inside the cache**: the kept tokens are numbered 0, 1, 2, ... in
stream order, so the query sits at ``min(t, S+W-1)``.

Because RoPE scores depend only on the difference between query and key positions, the in-cache
positions reduce to two cases, both computed from bounded numbers:

* a non-sink key ``u`` (in the ring or in the current chunk) is at in-cache distance ``t - u`` from
  the query, its true distance, which is < W. We rotate queries at their chunk offset ``c`` and keys
  at ``c'`` (chunk) or ``-d`` (ring key ``d`` tokens before the chunk), giving exactly ``t - u``.
* a sink key ``j`` is at distance ``min(t, S+W-1) - j``; we rotate a second copy of the query at
  ``min(t, S+W-1)`` and the sink keys at ``j``.

A chunk longer than the window is fed in blocks of ``W`` tokens inside the same jit
(``model.apply``), so chunk offsets, too, stay below ``W``: no rotated position leaves
``[-W, S+W)`` however long the prompt.

So no absolute stream position ever enters the arithmetic: the counters are ``length`` (filled
slots, saturating at ``S+W``) and ``head`` (next ring offset, in ``[0, W)``), neither of which grows
with the stream, and logits after a billion tokens are computed from the same small numbers as
after a thousand.

**Keys stored rotated** (``keys_rotated``, :func:`rotates_keys`). Rotating every cached key each
decode step is a pass over the whole cache, as costly as the scores themselves. So a float cache
of a RoPE model stores each key rotated *once*, at its slot's position (:func:`slot_positions`):
sink ``j`` at ``j``, ring offset ``i`` at ``i - W``. A decode step then scores the cache as it is,
with the query rotated three times (:func:`token_view`): at ``min(t, S+W-1)`` for the sinks, at
its own slot's position ``h - W`` for the ring keys written in its lap (offsets ``i <= h``, at
distance ``h - i``), and at ``h`` for the ones written a lap earlier (``i > h``, at distance
``h - i + W``): the true distances, from positions in ``[-W, S+W)``. Nothing is rotated twice in
place (HF's SinkCache drift). A chunk turns the stored keys to its chunk-relative positions with
one rotation by the difference (bounded by ``2W``), amortised over its tokens. Quantized stores,
score-based eviction and dynamic NTK (whose frequencies change with the length) keep pre-RoPE keys
and rotate them where they are read.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from ..bits import to_bits
from ..config import ModelConfig
from . import stores
from .stores import Bf16Bits


@struct.dataclass
class KVCache:
    """Per-layer keys (pre-RoPE, or rotated at their slot's position when the kind's
    ``keys_rotated``) and values plus per-row ring counters.

    ``k[l]``, ``v[l]``: [B, kv_heads, C, head_dim] (head-major, so each head's keys are one
    contiguous matrix for the score and value products), or a store of that shape
    (jaxllm.kv.stores); slots ``0..S-1`` hold the sinks, ``S..C-1`` the ring. ``length`` [B]:
    number of filled slots (= tokens seen, saturating at C). ``head`` [B]: ring offset the next
    non-sink token is written to. ``kind`` (static): what the cache keeps and how a chunk goes
    through it (jaxllm.kinds). ``state``: per layer, the kind's own state beside the keys and
    values (score-based eviction's jaxllm.kv.evict.Scores), else empty.
    """

    k: tuple  # per layer: Float[Array, "b n c h"], or a store of that shape (Bf16Bits, kvquant)
    v: tuple
    length: Int[Array, " b"]
    head: Int[Array, " b"]
    kind: Any = struct.field(pytree_node=False)  # a jaxllm.kinds.CacheKind
    state: tuple = ()

    @property
    def sinks(self) -> int:
        return self.kind.sinks

    @property
    def keys_rotated(self) -> bool:
        return self.kind.keys_rotated

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def window(self) -> int:
        return self.capacity - self.sinks

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def available_bytes():
    """Memory a new array can take on the default device: an accelerator's free memory, or
    the host's available memory on a CPU (None when unknown)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rotates_keys(cfg: ModelConfig) -> bool:
    """Whether a float cache for ``cfg`` may store its keys rotated at their slot's position
    (the module's note): RoPE models whose frequencies never change (not dynamic NTK)."""
    return (cfg.pos_emb == "rope" and cfg.rotary_dim > 0
            and (cfg.rope_scaling is None or cfg.rope_scaling.kind != "dynamic"))


def slot_positions(S: int, W: int) -> Int[Array, " c"]:
    """The position each slot's key is rotated at: ``j`` for sink ``j``, ``i - W`` for ring offset
    ``i`` (a constant: the position belongs to the slot, not to the token in it)."""
    s = jnp.arange(S + W, dtype=jnp.int32)
    return jnp.where(s < S, s, s - S - W)


def kv_bytes(cache: KVCache) -> int:
    """Bytes the cache's keys and values take (codes, scales, minima and sinks included),
    measured from its arrays."""
    return sum(a.nbytes for a in jax.tree.leaves((cache.k, cache.v)))


class ChunkLayout(NamedTuple):
    """Index arithmetic for one chunk, shared by every layer (computed once per forward)."""

    sink_from_chunk: Bool[Array, "b s"]  # sink slot j is filled by this chunk
    sink_chunk_idx: Int[Array, "b s"]  # ... from chunk token j - length (clipped)
    sink_mask: Bool[Array, "b t s"]  # query c may attend to sink j
    sink_q_pos: Int[Array, "b t"]  # in-cache query position min(t, S+W-1)
    rest_mask: Bool[Array, "b t l"]  # l = all S+W cache slots (sink slots masked) then T chunk
    ring_k_pos: Int[Array, "b c"]  # per cache slot: -d for the ring key d tokens before the chunk
    chunk_k_pos: Int[Array, "b t"]  # c': chunk offset of each chunk key
    rest_q_pos: Int[Array, "b t"]  # chunk offset c
    write_slot: Int[Array, "b t"]  # cache slot of each chunk token kept; S+W means dropped
    store_pos: Int[Array, "b t"]  # position of that slot (slot_positions; 0 if dropped)
    new_length: Int[Array, " b"]
    new_head: Int[Array, " b"]
    overflow: Bool[Array, " b"]  # a dense cache asked to hold more than it can (kinds.Dense)
    # For stores that quantize by stream order (KIVI): the state before the chunk and each
    # chunk token's rank among its non-sink tokens (-1: a sink or padding).
    old_head: Int[Array, " b"]
    ring_count: Int[Array, " b"]  # non-sink tokens in the ring before the chunk
    nonsink_rank: Int[Array, "b t"]
    first_nonsink: Int[Array, " b"]  # chunk index of the first non-sink token
    n_nonsink: Int[Array, " b"]
    # Which keys exist, for masks computed per block (jaxllm.attention.flash): the same
    # visibility as sink_mask and rest_mask, as key validity plus query - key distances.
    sink_ok: Bool[Array, "b s"]  # sink slot j is (or becomes) written
    ring_ok: Bool[Array, "b c"]  # a ring slot holds a token (sink slots: False)
    chunk_ok: Bool[Array, "b t"]  # a chunk token that is not a sink nor padding
    lens: Optional[Int[Array, " b"]] = None  # the chunk's valid tokens per row (0: left alone)

    @property
    def seen_length(self) -> Int[Array, " b"]:
        """What the chunk's last query sees: the cache after the chunk."""
        return self.new_length


def chunk_layout(cache: KVCache, lens: Int[Array, " b"], T: int) -> ChunkLayout:
    """Masks, in-cache positions and write slots for a chunk of ``T`` tokens (``lens`` valid)."""
    S, W = cache.sinks, cache.window
    B = cache.batch
    length, head = cache.length[:, None], cache.head[:, None]  # [B, 1]
    lens = lens[:, None]
    c = jnp.arange(T, dtype=jnp.int32)[None, :]  # [1, T] chunk offset of each token

    # Sinks: slot j holds stream token j; it comes from this chunk if j >= length.
    j = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
    sink_from_chunk = (j >= length) & (j - length < lens)
    sink_chunk_idx = jnp.clip(j - length, 0, max(T - 1, 0))
    sink_exists = (j < length) | sink_from_chunk
    # causal: sink j is visible to the token t = n + c iff j <= t; j < S <= length when saturated.
    sink_mask = sink_exists[:, None, :] & (j[:, None, :] <= (length + c)[:, :, None])
    sink_q_pos = jnp.minimum(length + c, S + W - 1)  # [B, T]

    # Ring: offset i holds the token d = (head-1-i) mod W + 1 tokens before the chunk.
    i = jnp.arange(W, dtype=jnp.int32)[None, :]
    d = jnp.mod(head - 1 - i, W) + 1  # [B, W]
    ring_count = jnp.maximum(length - S, 0)  # non-sink tokens currently in the ring
    ring_mask = (d <= ring_count)[:, None, :] & (c[:, :, None] + d[:, None, :] <= W - 1)

    # Chunk tokens: non-sinks are attended to through the rest part, within the window.
    # Chunk keys have the same offsets as chunk queries: c (a query, axis -2 of the masks) and
    # c' (a key, last axis) below are both `c`.
    nonsink = (length + c >= S) & (c < lens)  # [B, T]
    causal = (c[:, None, :] <= c[:, :, None]) & (c[:, :, None] - c[:, None, :] <= W - 1)
    chunk_mask = nonsink[:, None, :] & causal  # [B, T, T]

    # The ring part spans the whole cache, sink slots masked out (they are scored separately, at
    # their own positions): reading the full K/V arrays avoids copying a [S:] slice every step.
    rest_mask = jnp.concatenate([jnp.zeros((B, T, S), bool),
                                 jnp.broadcast_to(ring_mask, (B, T, W)), chunk_mask], axis=-1)
    ring_k_pos = jnp.concatenate([jnp.zeros((B, S), jnp.int32), -d], axis=1)
    rest_q_pos = jnp.broadcast_to(c, (B, T))

    # Writes: the sinks are set from sink_from_chunk; of the non-sink tokens only the last W of
    # the chunk survive it, and those have distinct ring slots (so the scatter is deterministic).
    n_sink_in_chunk = jnp.maximum(S - length, 0)  # [B, 1]
    rank = c - n_sink_in_chunk  # index among this chunk's non-sink tokens
    kept = nonsink & (lens - c <= W)
    # Chunk tokens that become sinks go to their own slot (length + c' < S) in the same scatter,
    # so each layer's cache is written once per chunk (a separate sink update made XLA copy it).
    new_sink = (length + c < S) & (c < lens)
    write_slot = jnp.where(kept, S + jnp.mod(head + rank, W),
                           jnp.where(new_sink, length + c, S + W))
    store_pos = jnp.where(kept, jnp.mod(head + rank, W) - W, jnp.where(new_sink, length + c, 0))
    n_nonsink = jnp.maximum(lens - n_sink_in_chunk, 0)
    new_head = jnp.mod(head + n_nonsink, W)[:, 0]
    new_length = jnp.minimum(length + lens, S + W)[:, 0]
    overflow = jnp.zeros((B,), bool)  # a ring always has room (a dense kind says otherwise)
    return ChunkLayout(sink_from_chunk, sink_chunk_idx, sink_mask, sink_q_pos, rest_mask,
                       ring_k_pos, jnp.broadcast_to(c, (B, T)), rest_q_pos, write_slot,
                       store_pos, new_length, new_head, overflow, old_head=head[:, 0],
                       ring_count=jnp.minimum(ring_count, W)[:, 0],
                       nonsink_rank=jnp.where(nonsink, rank, -1),
                       first_nonsink=jnp.minimum(n_sink_in_chunk, T)[:, 0],
                       n_nonsink=n_nonsink[:, 0], sink_ok=sink_exists,
                       ring_ok=jnp.concatenate([jnp.zeros((B, S), bool), d <= ring_count], 1),
                       chunk_ok=nonsink, lens=lens[:, 0])


def merge_sinks(cache_k: Float[Array, "b n c h"], chunk_k: Float[Array, "b n t h"],
                lay: ChunkLayout, S: int) -> Float[Array, "b n s h"]:
    """Sink slots after this chunk: the cached ones, or the chunk's first tokens while n < S."""
    from_chunk = jnp.take_along_axis(chunk_k, lay.sink_chunk_idx[:, None, :, None], axis=2)
    return jnp.where(lay.sink_from_chunk[:, None, :, None], from_chunk.astype(cache_k.dtype),
                     cache_k[:, :, :S])


def write_chunk(cache_k: Float[Array, "b n c h"], chunk_k: Float[Array, "b n t h"],
                lay: ChunkLayout) -> Float[Array, "b n c h"]:
    """The layer's cache after the chunk: one scatter of the chunk tokens that stay (new sinks
    to their sink slots, the last W non-sinks into the ring); the rest is dropped."""
    B, T = lay.write_slot.shape
    b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    # Advanced indices around a slice put their dims first: the update is [B, T, KVH, Dh].
    return cache_k.at[b_idx, :, lay.write_slot].set(
        chunk_k.transpose(0, 2, 1, 3).astype(cache_k.dtype), mode="drop")


def write_layer(layer_kv, chunk: Float[Array, "b n t h"], lay: ChunkLayout):
    """A layer's keys or values after the chunk is written into the sink slots and the ring
    (write_chunk)."""
    return stores.write(layer_kv, chunk, lay, lambda arr, rows: write_chunk(arr, rows, lay))


class TokenView(NamedTuple):
    """A decode step's view of the whole cache after its token is written (the module's note)."""

    q_pos: Int[Array, "b 3"]  # the query at min(t, S+W-1), at h - W and at h (h: its ring offset)
    k_pos: Int[Array, " c"]  # each slot's position (slot_positions)
    pick: Int[Array, "b c"]  # which of the three query positions scores each slot
    dist: Int[Array, "b c"]  # the in-cache distance query - key that this gives
    mask: Bool[Array, "b 1 c"]


def token_view(lay: ChunkLayout, S: int) -> TokenView:
    """Positions and mask over the ``S+W`` slots *after* a one-token chunk is written.

    A decode step writes its token first and then attends over the cache alone: reading the
    cache only after the in-place write lets XLA update the donated buffer without copying it
    (reading the old cache and then writing made XLA:CPU copy every layer's K and V twice per
    step). The written slot takes over the chunk token's mask; the slot's previous occupant is
    never visible to this query (an empty slot, or the ring token W back, which the window
    already excludes).
    """
    C = lay.ring_k_pos.shape[1]
    k_pos = slot_positions(S, C - S)  # [C]
    lap = lay.store_pos[:, :1]  # [B, 1]: h - W for a ring token (a sink sees no ring slot)
    q_pos = jnp.concatenate([lay.sink_q_pos[:, :1], lap, lap + (C - S)], axis=1)  # [B, 3]
    slot = jnp.arange(C, dtype=jnp.int32)[None, :]
    # A ring key ahead of the query's own slot was written a lap earlier.
    pick = jnp.where(slot < S, 0, jnp.where(k_pos[None, :] <= lap, 1, 2))  # [B, C]
    dist = jnp.take_along_axis(q_pos, pick, axis=1) - k_pos[None, :]
    written = (slot == lay.write_slot[:, :1])[:, None, :]  # [B, 1, C]
    rest = jnp.where(written, lay.rest_mask[..., C:C + 1], lay.rest_mask[..., :C])
    mask = jnp.concatenate([lay.sink_mask, rest[..., S:]], axis=-1)
    # A row with no token this step (lens 0: a pool's idle row) sees nothing, so the decode
    # kernel reads none of its cache; its output is meaningless and never used.
    mask = mask & (lay.write_slot[:, :1] < C)[:, :, None]
    return TokenView(q_pos, k_pos, pick, dist, mask)


def write_token(layer_kv, x: Float[Array, "b n 1 h"], lay: ChunkLayout):
    """A decode step's write of one token per row, then the read of the whole layer:
    ``(new layer_kv, its keys or values [B * n, C, h] as attention reads them)``.

    A float layer is updated and read as one [B * n, C, h] array (why: docs/CPU.md, "The
    cache's decode write").
    """
    if isinstance(layer_kv, Bf16Bits):  # in place; attention.decode.attend_cache widens what it reads
        bits, read = write_token(layer_kv.bits, to_bits(x), lay)
        return layer_kv.replace(bits=bits), read
    if not isinstance(layer_kv, jax.Array):  # a quantized store: written, then decoded
        new = write_layer(layer_kv, x, lay)
        read = stores.read(new, lay)
        return new, read.reshape((-1,) + read.shape[2:])
    B, n, C, h = layer_kv.shape
    flat = layer_kv.reshape(B * n, C, h)
    slot = jnp.repeat(lay.write_slot[:, 0], n)  # [B * n]; S+W (not written) is dropped
    merged = flat.at[jnp.arange(B * n), slot].set(x.reshape(B * n, h).astype(flat.dtype),
                                                  mode="drop")
    return merged.reshape(B, n, C, h), merged
