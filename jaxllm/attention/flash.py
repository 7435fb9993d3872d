"""Attention without the score matrix: keys in blocks, a running max and sum per query (the
online softmax of "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
Dao et al. 2022, Algorithm 1; "FlashAttention-2", Dao 2023, Algorithm 1).

The keys a chunk of queries sees come in *segments* (the sink slots, the ring, the chunk itself;
or just the sequence for a plain forward): each segment has its own query rotation and its own
positions, and its mask is computed per block from those positions, never stored as [T, L]::

    visible(q, k) = k_ok[k] and 0 <= q_pos[q] - k_pos[k] < span

One running state (max ``m``, sum ``l``, unnormalised output ``acc``) per query goes through every
segment in turn, so the result is the softmax over the concatenation of all of them: the same
probabilities as :func:`reference`, which materialises the scores and is the test oracle.

Forms, chosen by :func:`backend` from a ModelConfig's ``kernels.attention`` (``auto`` |
``blockwise`` | ``materialised`` | ``pallas``): the Pallas kernel on GPU and TPU
(:mod:`pallas_kernels.flash`), the blockwise jnp form everywhere else; ``materialised`` is the
reference, the way every forward attended before the blocks.
"""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import NEG_INF

from ..bits import widen
from ..config import ATTENTION_KERNELS
from ..rope import Rotation, apply_rope

BACKENDS = ATTENTION_KERNELS

# Elements of one block of scores (batch x heads x queries x keys, float32) the jnp form aims
# for: 2^24 is 64 MiB, a few of which (scores, probabilities, mask) live at once. The tests set
# a small one ($JAXLLM_SCORE_BLOCK), so that their tiny models attend in many blocks.
SCORE_BLOCK_ELEMENTS = int(os.environ.get("JAXLLM_SCORE_BLOCK", 1 << 24))


class Segment(NamedTuple):
    """One run of keys and values, and the queries as they score them.

    Queries and keys may come unrotated with their RoPE tables (``q_rot``, ``k_rot``): the
    blockwise form rotates a block at a time, so a cache is never copied whole as rotated
    float32 keys. ``k`` and ``v`` may be the uint16 bits of a bfloat16 cache (jaxllm.kv.stores'
    Bf16Bits), widened a block at a time. A rotation rounds to ``dtype`` (the stored keys'),
    as the materialised form rotates its bfloat16 keys in bfloat16.
    """

    q: Float[Array, "b t h d"]
    k: Float[Array, "b n l d"]  # head-major, the cache's layout
    v: Float[Array, "b n l d"]
    q_pos: Int[Array, "b t"]  # query positions in this segment's frame (mask, ALiBi)
    k_pos: Int[Array, "b l"]  # key positions in the same frame
    k_ok: Bool[Array, "b l"]  # keys that exist (written, not a sink scored elsewhere, ...)
    span: Optional[int] = None  # keys at distance >= span are out of the window (static)
    q_rot: Optional[Rotation] = None  # [B, T] tables the queries are rotated by
    k_rot: Optional[Rotation] = None  # [B, L] tables the keys are rotated by
    dtype: Optional[jnp.dtype] = None  # what rotated keys round to (default: k's dtype)

    def queries(self, start=None, size=None):
        """Rows ``start:start+size`` of the rotated queries (all of them by default)."""
        q, rot = self.q, self.q_rot
        if start is not None:
            q = jax.lax.dynamic_slice_in_dim(q, start, size, axis=1)
            rot = rot and _rows(rot, start, size)
        return q if rot is None else apply_rope(q, rot)

    def keys(self, start=None, size=None):
        """Keys ``start:start+size`` (all by default), rotated, and the values, both float."""
        k, v, rot = self.k, self.v, self.k_rot
        if start is not None:
            k, v = (jax.lax.dynamic_slice_in_dim(a, start, size, axis=2) for a in (k, v))
            rot = rot and _rows(rot, start, size)
        dt = self.dtype or (jnp.bfloat16 if k.dtype == jnp.uint16 else k.dtype)
        k, v = widen(k).astype(dt), widen(v)
        return (k if rot is None else apply_rope(k, rot, head_major=True)), v


def _rows(rot: Rotation, start, size) -> Rotation:
    return Rotation(*(None if a is None else jax.lax.dynamic_slice_in_dim(a, start, size, 1)
                      for a in rot))


class State(NamedTuple):
    """The online softmax's running state per query and head."""

    m: Float[Array, "b t h"]  # running max of the scores
    l: Float[Array, "b t h"]  # running sum of exp(score - m)
    acc: Float[Array, "b t h d"]  # running sum of exp(score - m) * value


def backend(choice: str) -> str:
    """The form ``choice`` names (a ModelConfig's ``kernels.attention``), ``auto`` resolved:
    pallas on GPU and TPU, blockwise elsewhere."""
    b = choice
    if b not in BACKENDS:
        raise ValueError(f"unknown attention backend {b!r}; choose one of {', '.join(BACKENDS)}")
    if b == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "blockwise"
    return b


def init_state(B: int, T: int, H: int, Dh: int, zero_sink: bool) -> State:
    """Nothing seen yet. Softmax-off-by-one (``zero_sink``) starts from its virtual key: score 0,
    value 0, i.e. max 0 and sum 1."""
    m0 = 0.0 if zero_sink else NEG_INF
    return State(jnp.full((B, T, H), m0, jnp.float32),
                 jnp.full((B, T, H), 1.0 if zero_sink else 0.0, jnp.float32),
                 jnp.zeros((B, T, H, Dh), jnp.float32))


def finish(state: State) -> Float[Array, "b t h d"]:
    return state.acc / state.l[..., None]


def attend(segments: list[Segment], slopes: Optional[Float[Array, " h"]] = None,
           zero_sink: bool = False, choice: str = "auto", threaded: bool = False
           ) -> tuple[Float[Array, "b t h d"], list[tuple[Array, Array]]]:
    """softmax over all segments' keys of q·k / sqrt(Dh) (- ALiBi's slope x distance), times the
    values -> (out [B, T, H, Dh] float32, every segment's (k, v) as it came out of the loops).
    ``slopes`` [H]: ALiBi (None: no bias).

    ``threaded`` (for a cache's chunk, which is not differentiated): write into the returned k
    and v, not the ones passed in. The blockwise form's loops then carry them through: an array
    that a loop reads and something writes after it is copied by XLA first (a whole cache
    layer, twice, per layer of a prefill block)."""
    b = backend(choice)
    if b == "materialised":
        return reference(segments, slopes, zero_sink), [(seg.k, seg.v) for seg in segments]
    if b == "pallas":
        return _by_kernel(segments, slopes, zero_sink), [(seg.k, seg.v) for seg in segments]
    return blockwise(segments, slopes, zero_sink, threaded)


def _by_kernel(segments: list[Segment], slopes, zero_sink: bool) -> Float[Array, "b t h d"]:
    """The Pallas kernel (pallas_kernels.flash), segment after segment through one head-major
    state: for the platform the program is lowered for, the Triton kernel on GPU and Mosaic on
    TPU (else, tests on a CPU, the Triton kernel in interpret mode).

    The kernel has no gradient of its own: a gradient (training) is the blockwise jnp form's,
    recomputed from the inputs, so it stays blockwise too (no [T, L] scores)."""
    statics = [(seg.span, seg.dtype) for seg in segments]
    arrays = [seg._replace(span=None, dtype=None) for seg in segments]  # leaves only

    def rebuild(arrays):
        return [a._replace(span=sp, dtype=dt) for a, (sp, dt) in zip(arrays, statics)]

    def forward(arrays, slopes):
        return _kernel_forward(rebuild(arrays), slopes, zero_sink)

    def by_blocks(arrays, slopes):
        return blockwise(rebuild(arrays), slopes, zero_sink)[0]

    run = jax.custom_vjp(forward)
    run.defvjp(lambda arrays, slopes: (forward(arrays, slopes), (arrays, slopes)),
               lambda res, g: jax.vjp(by_blocks, *res)[1](g))
    return run(arrays, slopes)


def _kernel_forward(segments: list[Segment], slopes, zero_sink: bool):
    from pallas_kernels import flash as kernel  # the kernels sit above the library
    B, T, H, Dh = segments[0].q.shape
    st = init_state(B, T, H, Dh, zero_sink)
    m, l, acc = (jnp.moveaxis(a, 1, 2) for a in st)  # [B, H, T, ...]
    for seg in segments:
        if not seg.k.shape[2]:
            continue
        k, v = seg.keys()
        args = (m, l, acc, jnp.moveaxis(seg.queries(), 1, 2), k, v, seg.q_pos, seg.k_pos,
                seg.k_ok, slopes)
        by = lambda backend, interpret=False: functools.partial(
            kernel.flash_segment, span=seg.span, backend=backend, interpret=interpret)
        m, l, acc = jax.lax.platform_dependent(*args, cuda=by("triton"), rocm=by("triton"),
                                               tpu=by("tpu"), default=by("triton", True))
    return jnp.moveaxis(acc / l[..., None], 1, 2)


def _scores(q, k, q_pos, k_pos, k_ok, span, slopes):
    """Masked scores of query rows q [B, tq, KVH, G, Dh] against keys k [B, KVH, tk, Dh]
    -> [B, KVH, G, tq, tk] float32; q_pos [B, tq], k_pos/k_ok [B, tk]."""
    Dh = q.shape[-1]
    s = jnp.einsum("bqkgd,bksd->bkgqs", q.astype(jnp.float32), k.astype(jnp.float32))
    s = s / math.sqrt(Dh)
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [B, tq, tk]
    if slopes is not None:
        KVH, G = q.shape[2:4]
        s = s - slopes.reshape(1, KVH, G, 1, 1) * dist[:, None, None].astype(jnp.float32)
    ok = k_ok[:, None, :] & (dist >= 0)
    if span is not None:
        ok = ok & (dist < span)
    return jnp.where(ok[:, None, None], s, NEG_INF)


def reference(segments: list[Segment], slopes=None, zero_sink: bool = False
              ) -> Float[Array, "b t h d"]:
    """The materialised form: every segment's [T, L] scores, one softmax over their
    concatenation, then the values. The oracle of the blockwise forms."""
    B, T, H, Dh = segments[0].q.shape
    KVH = segments[0].k.shape[1]
    G = H // KVH
    scores, values = [], []
    for seg in segments:
        k, v = seg.keys()
        q = seg.queries().reshape(B, T, KVH, G, Dh)
        scores.append(_scores(q, k, seg.q_pos, seg.k_pos, seg.k_ok, seg.span, slopes))
        values.append(v)
    s = jnp.concatenate(scores, -1)
    if zero_sink:  # softmax-off-by-one: a virtual key with score 0 and value 0
        s = jnp.concatenate([jnp.zeros_like(s[..., :1]), s], -1)
    p = jax.nn.softmax(s, -1)[..., int(zero_sink):]
    out = jnp.einsum("bkgqs,bksd->bqkgd", p, jnp.concatenate(values, 2))
    return out.reshape(B, T, H, Dh)


def block_sizes(B: int, H: int, T: int, L: int) -> tuple[int, int]:
    """(queries, keys) per block of the jnp form: powers of two whose [B, H, bq, bk] scores hold
    about SCORE_BLOCK_ELEMENTS, at most the lengths themselves."""
    side = 2 ** max(3, int(math.log2(math.sqrt(SCORE_BLOCK_ELEMENTS / (B * H)))))
    return min(T, side), min(L, side)


def blockwise(segments: list[Segment], slopes=None, zero_sink: bool = False,
              threaded: bool = False) -> tuple[Float[Array, "b t h d"], list[tuple[Array, Array]]]:
    """The jnp form: for each block of queries, every segment's keys a block at a time into
    one running state, then the block's output. The largest temporaries are a block of scores
    and the output, never [T, L]. Returns what :func:`attend` does.

    A block that would run past the end starts earlier instead (no padding copies of the
    cache): its keys seen in the block before are masked, its queries done before are kept.

    Two loop forms. ``threaded`` (a cache's chunk, never differentiated): the keys and values
    ride through both loops' carries and come back out, so a write after them is in place
    (:func:`attend`'s note). Otherwise (a plain forward, which training differentiates): a scan
    over query blocks whose body is checkpointed, so a gradient keeps one block index per query
    block and recomputes the rest; carried keys would be kept once per block.
    """
    B, T, H, Dh = segments[0].q.shape
    KVH = segments[0].k.shape[1]
    G = H // KVH
    bq = block_sizes(B, H, T, 1)[0]
    nq = -(-T // bq)

    def key_block(j, carry, seg: Segment, bk: int, q, q_pos):
        m, l, acc = carry[:3]  # [B, KVH, G, bq], the same, [B, KVH, G, bq, Dh]
        if len(carry) == 4:  # threaded: this segment's (k, v) in the carry
            seg = seg._replace(k=carry[3][0], v=carry[3][1])
        L = seg.k.shape[2]
        start = jnp.minimum(j * bk, L - bk)
        k, v = seg.keys(start, bk)
        k_pos, k_ok = (jax.lax.dynamic_slice_in_dim(a, start, bk, axis=1)
                       for a in (seg.k_pos, seg.k_ok))
        s = _scores(q, k, q_pos, k_pos, k_ok, seg.span, slopes)  # [B, KVH, G, bq, bk]
        # Keys seen in the block before count for nothing, not even as masked keys (which a
        # row that sees no key at all averages uniformly, as the materialised form does).
        s = jnp.where(start + jnp.arange(bk) >= j * bk, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        fix = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bksd->bkgqd", p, v)
        return (m_new, l * fix + p.sum(-1), acc * fix[..., None] + pv) + tuple(carry[3:])

    def block_out(i, kvs):
        """Query block i against every segment -> (o [B, bq, H, Dh], the (k, v) carried)."""
        start = jnp.minimum(i * bq, T - bq)
        m0 = 0.0 if zero_sink else NEG_INF  # softmax-off-by-one: a virtual key, score 0
        state = (jnp.full((B, KVH, G, bq), m0, jnp.float32),
                 jnp.full((B, KVH, G, bq), float(zero_sink), jnp.float32),
                 jnp.zeros((B, KVH, G, bq, Dh), jnp.float32))
        new_kvs = []
        for seg, kv in zip(segments, kvs):
            L = seg.k.shape[2]
            if not L:
                new_kvs.append(kv)
                continue
            q = seg.queries(start, bq).reshape(B, bq, KVH, G, Dh)
            q_pos = jax.lax.dynamic_slice_in_dim(seg.q_pos, start, bq, axis=1)
            bk = block_sizes(B, H, bq, L)[1]
            # Checkpointed: a gradient keeps each key block's running state and recomputes
            # its scores, instead of keeping them all.
            body = jax.checkpoint(lambda j, c, seg=seg, bk=bk, q=q, q_pos=q_pos:
                                  key_block(j, c, seg, bk, q, q_pos))
            out = jax.lax.fori_loop(0, -(-L // bk), body, state + ((kv,) if threaded else ()))
            state = out[:3]
            new_kvs.append(out[3] if threaded else kv)
        m, l, acc = state
        return jnp.moveaxis(acc / l[..., None], 3, 1).reshape(B, bq, H, Dh), tuple(new_kvs)

    kvs = tuple((seg.k, seg.v) for seg in segments)
    if threaded:
        def query_block(i, carry):
            out, kvs = carry
            start = jnp.minimum(i * bq, T - bq)
            o, kvs = block_out(i, kvs)
            done = (start + jnp.arange(bq) < i * bq)[None, :, None, None]
            o = jnp.where(done, jax.lax.dynamic_slice_in_dim(out, start, bq, axis=1), o)
            return jax.lax.dynamic_update_slice_in_dim(out, o, start, axis=1), kvs

        out, kvs = jax.lax.fori_loop(0, nq, query_block,
                                     (jnp.zeros((B, T, H, Dh), jnp.float32), kvs))
        return out, list(kvs)
    body = jax.checkpoint(lambda c, i: (c, block_out(i, kvs)[0]))
    _, blocks = jax.lax.scan(body, None, jnp.arange(nq))  # [nq, B, bq, H, Dh]
    # The last block started at T - bq: keep only its rows past the block before it.
    head = jnp.moveaxis(blocks[:-1], 0, 1).reshape(B, (nq - 1) * bq, H, Dh)
    return jnp.concatenate([head, blocks[-1][:, nq * bq - T:]], 1), list(kvs)
