"""Score-based KV eviction in the fixed-shape cache: H2O (Zhang et al. 2023, §4 "greedy
algorithm") and Q-Hitter (Zhang et al. 2024, §3, Eq. 3), with position rolling.

The cache of a row holds ``S`` sinks (the first tokens of the stream, never evicted; ``S = 0`` is
the authors' setting), ``H`` heavy hitters and the ``R`` most recent tokens, per layer and per KV
head: heads choose independently, as in the authors' layer-wise cache. The arrays have
``C + 1`` slots (``C = S + H + R``): the extra one is *free*, and each decode step writes its token
there, attends over all ``C + 1`` (the authors attend over hh + recent + 1), adds the attention
it paid to every slot to that slot's accumulated score, and then evicts one token, whose slot
becomes the next free one. So a decode step writes one row of K and V and never moves the others.

Scores (docs/METHODS.md §4, the authors' ``H2OKVCache_LayerWise``):

* accumulated attention: every query's softmax row is added to the scores of the keys it saw,
  summed over the query heads of a KV head's group (GQA: the authors handle MHA only, where the
  group is one head) and over the chunk's queries; scores are not normalised, an evicted token's
  score is discarded with it.
* candidates: kept tokens that are neither sinks nor among the ``R`` most recent (the new token
  counts as recent); H2O evicts the candidate with the lowest accumulated score.
* Q-Hitter ranks candidates by ``λ·minmax(acc) + (1 - λ)·(1 - (ê_K + ê_V)/2)`` where ê is the
  L2 norm of a token's quantization error (over head_dim, as the cache's quantizer stores it),
  min-max normalised over the layer's kept tokens and heads; first the ``A`` candidates with the
  highest accumulated attention are kept regardless (the authors' "default" 7% share), then the
  rest compete on the combined score. ``λ = 1`` is H2O ("H2O+quant" with a quantized cache).
  Departure: the authors normalise each new token's error once, across heads only, when it is
  written (NaN with one KV head); here the raw errors are stored and normalised at selection
  time over everything kept, which is defined for any head count.

Positions ("position rolling", the authors' ``H2OLlamaAttention_streaming``): keys are cached
before RoPE and sit at their order among the kept tokens, ``rank`` 0..m-1, the query at ``m``.
A rank is renumbered when a token before it leaves (ranks above the victim drop by one), so
every position stays below ``C + T``: the stream never enters the arithmetic, and counters stay
bounded over any number of tokens.

Chunks (prefill): a chunk of ``T`` tokens attends to everything kept plus its own tokens
causally ("prefill attends fully"), then the ``C + T`` entries are compressed once to ``C``
(sinks and recent first, then the best scores), in stream order (slot i = rank i). So a prompt
fed in one call is compressed once after full attention, as the authors do; its positions reach
``C + T``, bounded by the chunk the caller chose (decode steps stay below ``C + 1``).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

# Why KIVI's store and score-based eviction do not mix (refused by the policy and the cache).
KIVI_BREAKS = "KIVI's key blocks follow a ring's order, which score-based eviction breaks"

METHODS = ("h2o", "qhitter")


@dataclasses.dataclass(frozen=True)
class Evict:
    """How a score-based cache chooses what to keep (static under jit).

    ``heavy`` (H) slots for heavy hitters, ``recent`` (R >= 1) for the most recent tokens;
    ``attn_only`` (A <= H, Q-Hitter): of the heavy slots, those filled by accumulated attention
    alone; ``lam`` (λ): Q-Hitter's weight of attention against quantization friendliness."""

    method: str = "h2o"
    heavy: int = 64
    recent: int = 64
    attn_only: int = 0
    lam: float = 1.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown eviction method {self.method!r}; choose h2o or qhitter")
        if self.heavy < 0:
            raise ValueError(f"heavy must be >= 0 (heavy-hitter slots), got {self.heavy}")
        if self.recent < 1:
            raise ValueError(f"recent must be >= 1: the newest token is always kept, got "
                             f"{self.recent}")
        if not 0 <= self.attn_only <= self.heavy:
            raise ValueError(f"attn_only (heavy slots chosen by attention alone) must lie in "
                             f"[0, heavy={self.heavy}], got {self.attn_only}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam (λ, attention's weight in Q-Hitter's score) must lie in "
                             f"[0, 1], got {self.lam}")

    @property
    def uses_error(self) -> bool:
        """Whether the quantization error enters the ranking (Q-Hitter with λ < 1)."""
        return self.method == "qhitter" and self.lam < 1.0


@struct.dataclass
class Scores:
    """One layer's eviction state, per row and KV head over the ``C + 1`` slots."""

    acc: Float[Array, "b n c"]  # accumulated attention
    rank: Int[Array, "b n c"]  # order among the kept tokens (their position); -1: empty
    err: Float[Array, "b n c 2"]  # L2 quantization error of the key and the value (Q-Hitter)
    free: Int[Array, "b n"]  # the slot the next token is written to


def empty_scores(batch: int, kv_heads: int, slots: int) -> Scores:
    return Scores(acc=jnp.zeros((batch, kv_heads, slots), jnp.float32),
                  rank=jnp.full((batch, kv_heads, slots), -1, jnp.int32),
                  err=jnp.zeros((batch, kv_heads, slots, 2), jnp.float32),
                  free=jnp.zeros((batch, kv_heads), jnp.int32))


class Layout(NamedTuple):
    """A chunk's positions and masks in a score-based cache (shared by the layers)."""

    n: Int[Array, " b"]  # tokens kept before the chunk (the cache's length)
    lens: Int[Array, " b"]  # valid tokens of the chunk
    pos: Int[Array, "b t"]  # chunk token c sits at n + c (its rank among kept + chunk)
    valid: Bool[Array, "b t"]
    chunk_mask: Bool[Array, "b t t"]  # causal within the chunk, valid keys only
    new_length: Int[Array, " b"]
    sinks: int
    keep: int  # C = S + H + R
    spec: Evict

    @property
    def seen_length(self) -> Int[Array, " b"]:
        """What the chunk's last query sees: the kept tokens and the chunk."""
        return self.n + self.lens


def layout(length: Int[Array, " b"], lens: Int[Array, " b"], T: int, sinks: int, keep: int,
           spec: Evict) -> Layout:
    c = jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = c < lens[:, None]
    mask = (c[:, None, :] <= c[:, :, None]) & valid[:, None, :]
    return Layout(length, lens, length[:, None] + c, valid, mask,
                  jnp.minimum(length + lens, keep), sinks, keep, spec)


def token_error(x: Float[Array, "b n t h"], roundtrip) -> Float[Array, "b n t"]:
    """L2 norm over head_dim of what storing ``x`` loses (``roundtrip(x)``: as stored)."""
    xf = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(roundtrip(xf).astype(jnp.float32) - xf), -1))


def _minmax(x, valid):
    """(x - min) / (max - min) over the valid entries of each row (axes 1..), 0 if constant."""
    axes = tuple(range(1, x.ndim))
    lo = jnp.min(jnp.where(valid, x, jnp.inf), axis=axes, keepdims=True)
    hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axes, keepdims=True)
    span = hi - lo
    return jnp.where(valid & (span > 0), (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def top_mask(x: Float[Array, "... e"], valid: Bool[Array, "... e"], k: int
             ) -> Bool[Array, "... e"]:
    """The ``k`` largest valid entries of each row (all of them if fewer), ties going to the
    lower index: the set ``lax.top_k`` picks, without its sort (on CPU, sorting 4,096 slots per
    head in every layer cost a third of a Q-Hitter decode step).

    The k-th largest value is found bit by bit, from the top, as the largest uint32 key with at
    least k valid keys at or above it: 32 counting passes. A float's key (its bits, all flipped
    if negative, else the sign bit set) orders like the float."""
    x = jnp.where(x == 0, 0.0, x.astype(jnp.float32))  # -0.0 ties with 0.0, as in top_k
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    key = bits ^ jnp.where(bits >> 31 == 1, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))

    def bit(i, kth):  # set bit 31 - i if k keys still reach the larger threshold
        c = kth | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(jnp.sum(valid & (key >= c[..., None]), -1) >= k, c, kth)
    kth = jax.lax.fori_loop(0, 32, bit, jnp.zeros(x.shape[:-1], jnp.uint32))[..., None]
    above = valid & (key > kth)
    tie = valid & (key == kth)
    tie_rank = jnp.cumsum(tie, -1) - tie  # among the ties, the lower index first
    return above | (tie & (tie_rank < k - jnp.sum(above, -1, keepdims=True)))


def _ranking(acc, order, err, m, spec: Evict, S: int):
    """Who is kept regardless, and the score the remaining candidates compete on.

    acc, order [B, N, E] (order: stream order among the entries, -1 empty), err [B, N, E, 2],
    m [B] entries in all. Returns (protected, candidate, score), the first two boolean."""
    valid = order >= 0
    protected = valid & ((order < S) | (order >= m[:, None, None] - spec.recent))
    cand = valid & ~protected
    if spec.method == "h2o":
        return protected, cand, acc
    if spec.attn_only:  # Q-Hitter's default share: the top-A candidates by attention alone
        chosen = top_mask(acc, cand, spec.attn_only)
        protected, cand = protected | chosen, cand & ~chosen
    score = spec.lam * _minmax(acc, valid)
    if spec.lam < 1.0:  # Eq. 3: quantization friendliness 1 - (ê_K + ê_V) / 2
        e = (_minmax(err[..., 0], valid) + _minmax(err[..., 1], valid)) / 2
        score = score + (1.0 - spec.lam) * (1.0 - e)
    return protected, cand, score


def decode_update(sc: Scores, probs: Float[Array, "b n g 1 c"], n: Int[Array, " b"],
                  active: Bool[Array, " b"], spec: Evict, S: int) -> Scores:
    """After a decode step attended over all slots (its token written at ``sc.free``, rank
    ``n``): add the attention paid, then evict one candidate if more than ``C`` are held."""
    C = sc.acc.shape[-1] - 1
    act = active[:, None, None]
    acc = sc.acc + jnp.where(act, jnp.sum(probs, axis=(2, 3)), 0.0)
    m = n + 1  # entries after the write
    protected, cand, score = _ranking(acc, sc.rank, sc.err, m, spec, S)
    victim = jnp.argmin(jnp.where(cand, score, jnp.inf), axis=-1)  # [B, N]
    evict = act[..., 0] & (m > C)[:, None]  # [B, N]
    v_rank = jnp.take_along_axis(sc.rank, victim[..., None], -1)  # [B, N, 1]
    at_victim = jnp.arange(C + 1)[None, None] == victim[..., None]
    e = evict[..., None]
    rank = jnp.where(e & at_victim, -1, jnp.where(e & (sc.rank > v_rank), sc.rank - 1, sc.rank))
    acc = jnp.where(e & at_victim, 0.0, acc)
    free = jnp.where(evict, victim, jnp.where(act[..., 0], jnp.minimum(m, C)[:, None], sc.free))
    return sc.replace(acc=acc, rank=rank, free=free.astype(jnp.int32))


def written(sc: Scores, n: Int[Array, " b"], active: Bool[Array, " b"],
            err: Float[Array, "b n 2"]) -> Scores:
    """The scores after a decode step's token is written at ``sc.free`` (rank ``n``)."""
    at = (jnp.arange(sc.acc.shape[-1])[None, None] == sc.free[..., None]) & \
        active[:, None, None]  # [B, N, C+1]
    return sc.replace(acc=jnp.where(at, 0.0, sc.acc),
                      rank=jnp.where(at, n[:, None, None], sc.rank),
                      err=jnp.where(at[..., None], err[:, :, None, :], sc.err))


def compress(sc: Scores, p_cache: Float[Array, "b n c"], p_chunk: Float[Array, "b n t"],
             err_chunk: Float[Array, "b n t 2"], lay: Layout, spec: Evict
             ) -> tuple[Scores, Int[Array, "b n c"]]:
    """After a chunk attended to the kept tokens and itself (``p_*``: attention summed over
    its queries and each KV head's query heads): keep ``C`` of the ``C + 1 + T`` entries (cache
    slots, then chunk tokens) and lay them out in stream order. Returns the new scores and, per
    new slot, the entry it takes (``C + 1 + t`` for chunk token t) for gathering K and V."""
    B, N, C1 = sc.acc.shape
    C = C1 - 1
    T = p_chunk.shape[-1]
    order = jnp.concatenate([sc.rank, jnp.broadcast_to(
        jnp.where(lay.valid, lay.pos, -1)[:, None], (B, N, T))], -1)  # [B, N, C1+T]
    acc = jnp.concatenate([sc.acc + p_cache, p_chunk], -1)
    err = jnp.concatenate([sc.err, err_chunk], -2)
    m = lay.n + lay.lens
    protected, cand, score = _ranking(acc, order, err, m, spec, lay.sinks)
    priority = jnp.where(protected, jnp.inf, jnp.where(cand, score, -jnp.inf))
    top_p, top = jax.lax.top_k(priority, C)  # the C best, then into stream order
    kept = top_p > -jnp.inf
    top_order = jnp.take_along_axis(order, top, -1)
    perm = jnp.argsort(jnp.where(kept, top_order, jnp.iinfo(jnp.int32).max), axis=-1)
    idx = jnp.take_along_axis(top, perm, -1)
    kept = jnp.take_along_axis(kept, perm, -1)
    idx = jnp.concatenate([idx, jnp.full((B, N, 1), C1 + T - 1, idx.dtype)], -1)  # free slot
    kept = jnp.concatenate([kept, jnp.zeros((B, N, 1), bool)], -1)
    slot = jnp.arange(C1, dtype=jnp.int32)[None, None]
    new = Scores(acc=jnp.where(kept, jnp.take_along_axis(acc, idx, -1), 0.0),
                 rank=jnp.where(kept, slot, -1),
                 err=jnp.where(kept[..., None], jnp.take_along_axis(err, idx[..., None], -2), 0.0),
                 free=jnp.sum(kept, -1).astype(jnp.int32))
    return new, idx
