"""The Pallas kernel of a decode step's attention over a KV cache *as stored*: one query per
sequence and head against a run of cache slots, each block of keys and values read in its
storage format and dequantized in registers, so no float copy of the cache is ever made:

* ``float``: bfloat16, float16 or float32 keys or values;
* ``int8``: int8 codes with a scale per token (and head);
* ``token``: k-bit codes with a scale and a minimum per token and group of channels
  (Q-Hitter's quantizer; KIVI's values);
* ``channel``: k-bit codes with a scale and a minimum per channel and group of ``group``
  consecutive slots (KIVI's keys, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache", Liu et al. 2024, Section 3.2).

Keys stored before RoPE are rotated after dequantizing, by angle addition: block b's slot
b0 + t turns by angle (b0 + t)·θ = b0·θ + t·θ, so a per-block table (cos, sin of b0·θ) and one
table for t in [0, bk) give every slot's rotation with two products each, and no table of the
whole cache is read by every head. (The reference's table computes cos(fl(pos·θ)) directly; the
two agree to float32's rounding of the angle, about pos·θ·6e-8 radians.)

Split over the slots ("Flash-Decoding for long-context inference", Dao et al. 2023): each of
``splits`` programs per (sequence, KV head) folds its share of the slots into an online softmax
(max m, sum l, unnormalised output acc; "FlashAttention-2", Dao 2023, Algorithm 1), so a batch
of one with few KV heads still has enough programs for the GPU; the caller combines the splits
with the keys the kernel does not read (full-precision sinks, KIVI's recent tokens).

Channel order. 2- and 4-bit codes are packed ``per = 32 / bits`` to a uint32 word, code j of
word w being channel w·per + j (jaxllm.kv.quantized.pack). Shifting a block of words by j·bits
gives field j, the channels {w·per + j}: the kernel works in this *permuted* channel order
(:func:`permute`) throughout, so unpacking never interleaves. The query, the rotation tables
and per-channel scales come permuted, the output leaves permuted. RoPE's pairs (c, c + D/2)
are word w and word w + P/2 of the same field (P = D / per words), so the rotation stays
elementwise. Unpacked formats have per = 1 and the natural order.

Scores and weighted sums are elementwise products and row sums (a decode step has one query row
per head and rotation, too few for a matrix unit), in float32. Two lowerings of one block update
(``_block``), as pallas_kernels.flash: ``triton`` (a program per (row, split) walks its blocks
in a loop, the last block of the slots moved back to end at the last slot, its repeated slots
masked) and ``tpu`` (the blocks as the last grid axis, the state in VMEM scratch; the slots past
the end of a partial last block masked). Both run on CPU in interpret mode;
pallas_kernels.reference.decode_partials is the jnp form of the same computation.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from .common import NEG_INF

KINDS = ("float", "int8", "token", "channel")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one side (keys or values) of the slots is stored. ``arrays`` of :func:`partials`
    take, per kind, for N rows (sequence x KV head) and L slots:

    * float: ``(x [N, L, D],)``;
    * int8: ``(codes [N, L, D] int8, scale [N, L, 1])``;
    * token: ``(codes [N, L, P], scale [N, L, D/group], minimum [N, L, D/group])``;
    * channel: ``(codes [N, L, P], scale [N, L/group, D], minimum [N, L/group, D])``, the
      scales in the permuted channel order.

    P = D·bits/32 uint32 words when ``bits`` is 2 or 4, else D bytes (uint8)."""

    kind: str
    bits: int = 16
    group: int = 0  # token: channels per scale (0: the whole head); channel: slots per scale

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"stored layout kind {self.kind!r} is unknown; choose one of "
                             f"{', '.join(KINDS)}")

    @property
    def packed(self) -> bool:
        return self.kind in ("token", "channel") and self.bits in (2, 4)

    @property
    def per(self) -> int:
        """Codes per storage word (the channel permutation's stride)."""
        return 32 // self.bits if self.packed else 1

    def channel_group(self, D: int) -> int:
        """Channels that share one scale column (the whole head for per-token scales)."""
        return (self.group or D) if self.kind == "token" else D


class Rope(NamedTuple):
    """RoPE for keys stored before it: slot i at position ``first + i`` turned by inverse
    frequencies ``freq`` [B, D/2] (the natural channel order), cos and sin times ``scale``
    (YaRN's attention temperature; the queries come with theirs)."""

    freq: Float[Array, "b r"]
    first: int
    scale: float = 1.0


def permute(x: Array, per: int) -> Array:
    """Channels (last axis, D) into the packed words' order: entry j·P + w is channel w·per + j
    (P = D / per)."""
    if per == 1:
        return x
    D = x.shape[-1]
    return x.reshape(*x.shape[:-1], D // per, per).swapaxes(-1, -2).reshape(x.shape)


def unpermute(x: Array, per: int) -> Array:
    """The inverse of :func:`permute`."""
    if per == 1:
        return x
    D = x.shape[-1]
    return x.reshape(*x.shape[:-1], per, D // per).swapaxes(-1, -2).reshape(x.shape)


def _tables(rope: Rope, L: int, bk: int, clamp: bool, per: int):
    """(cos0, sin0 [B, nb, D/2] at each block's first slot, times the scale; cos_t, sin_t
    [B, bk, D/2] at offsets within a block), permuted. Block b starts at b·bk, on Triton
    (``clamp``) the last one moved back to end at slot L."""
    nb = -(-L // bk)
    start = jnp.arange(nb, dtype=jnp.int32) * bk
    if clamp:
        start = jnp.minimum(start, L - bk)
    f = rope.freq.astype(jnp.float32)[:, None, :]  # [B, 1, D/2]
    a0 = (rope.first + start).astype(jnp.float32)[None, :, None] * f
    at = jnp.arange(bk, dtype=jnp.float32)[None, :, None] * f
    return tuple(permute(x, per) for x in (rope.scale * jnp.cos(a0), rope.scale * jnp.sin(a0),
                                           jnp.cos(at), jnp.sin(at)))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about one call."""

    k: Layout
    v: Layout
    D: int
    G: int  # query heads per KV head
    Rq: int  # query rotations per head (``pick`` chooses one per slot)
    L: int
    bk: int
    nbs: int  # blocks per split
    rope: bool
    alibi: bool

    @property
    def per(self) -> int:
        return self.k.per

    @property
    def P(self) -> int:
        return self.D // self.per

    def tiles(self, lay: Layout, split_halves: bool):
        """Column tiles of one side: (first word, words, scale column) each. A tile lies in one
        scale group and, for rotated keys, in one half of the head."""
        span = self.D // 2 if split_halves else self.D
        width = min(lay.channel_group(self.D), span)  # channels per tile
        wt = width // self.per
        Gc = lay.channel_group(self.D)
        return [(t * wt, wt, (t * width) // Gc) for t in range(self.D // width)]

    def n_arrays(self, lay: Layout) -> int:
        return {"float": 1, "int8": 2, "token": 3, "channel": 3}[lay.kind]


def _field(spec: _Spec, lay: Layout, raw, arr, tile, j: int):
    """Field j of one tile of a block, dequantized to float32 [bk, wt]. ``raw`` is the tile's
    stored words or values [bk, wt]; ``arr(i, c0, w, row)`` loads array i of the side (its
    [bk, w] columns, or with ``row`` the one row of per-channel scales of the block)."""
    w0, wt, col = tile
    if lay.packed:
        mask = (1 << lay.bits) - 1
        x = ((raw >> (lay.bits * j)) & mask).astype(jnp.int32).astype(jnp.float32)
    else:
        x = raw.astype(jnp.float32)
    if lay.kind == "float":
        return x
    if lay.kind == "int8":
        return x * arr(1, 0, 1, False).astype(jnp.float32)
    if lay.kind == "token":
        return (x * arr(1, col, 1, False).astype(jnp.float32)
                + arr(2, col, 1, False).astype(jnp.float32))
    c0 = j * spec.P + w0  # channel kind: this field's scales, one row per block
    return (x * arr(1, c0, wt, True).astype(jnp.float32)
            + arr(2, c0, wt, True).astype(jnp.float32))


def _block(spec: _Spec, ld, valid, state):
    """Fold one block of ``bk`` slots into the state. ``ld`` loads: ``ld.k(i, c0, w, row)`` and
    ``ld.v(...)`` the sides' arrays (see _field), ``ld.q(r, g, c0, w)`` [1, w] of the query,
    ``ld.rope(i, c0, w)`` [bk, w] (i = 0, 1: cos, sin of this block's slots), ``ld.pick()``,
    ``ld.dist()`` [bk, 1] int32, ``ld.slope(g)`` [1, 1]. ``valid`` [bk, 1]: slots of this block
    (not repeats, not past the end). state: per query head g, (m [1, 1], l [1, 1], acc: per
    value tile and field [1, wt])."""
    P, per = spec.P, spec.per
    # Scores, as products accumulated per (rotation, head) and summed once over the channels.
    prods = {}

    def add(x, c0):
        for r in range(spec.Rq):
            for g in range(spec.G):
                y = x * ld.q(r, g, c0, x.shape[1])
                prods[r, g] = y if (r, g) not in prods else prods[r, g] + y

    tiles = spec.tiles(spec.k, spec.rope)
    raws = [ld.k(0, w0, wt, False) for w0, wt, _ in tiles]
    half = len(tiles) // 2
    for j in range(per):
        fields = [_field(spec, spec.k, raw, ld.k, tile, j) for raw, tile in zip(raws, tiles)]
        if not spec.rope:
            for x, (w0, _, _) in zip(fields, tiles):
                add(x, j * P + w0)
            continue
        for t in range(half):  # tile t (first half of the head) pairs with tile t + half
            (w0, wt, _), (w1, _, _) = tiles[t], tiles[t + half]
            cos, sin = ld.rope(0, j * (P // 2) + w0, wt), ld.rope(1, j * (P // 2) + w0, wt)
            a, b = fields[t], fields[t + half]
            add(a * cos - b * sin, j * P + w0)
            add(b * cos + a * sin, j * P + w1)
    sums = {rg: jnp.sum(y, axis=1, keepdims=True) for rg, y in prods.items()}  # [bk, 1]

    pick = ld.pick()
    ok = valid & (pick >= 0)
    dist = ld.dist().astype(jnp.float32) if spec.alibi else None
    vtiles = spec.tiles(spec.v, False)
    vraws = [ld.v(0, w0, wt, False) for w0, wt, _ in vtiles]
    vfields = [[_field(spec, spec.v, raw, ld.v, tile, j) for raw, tile in zip(vraws, vtiles)]
               for j in range(per)]
    new = []
    for g, (m, l, acc) in enumerate(state):
        s = sums[spec.Rq - 1, g]
        for r in range(spec.Rq - 2, -1, -1):
            s = jnp.where(pick == r, sums[r, g], s)
        if spec.alibi:
            s = s - ld.slope(g) * dist
        s = jnp.where(ok, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=0, keepdims=True))
        p = jnp.where(ok, jnp.exp(s - m_new), 0.0)  # [bk, 1]
        fix = jnp.exp(m - m_new)
        acc = [[a * fix + jnp.sum(jnp.where(ok, p * x, 0.0), axis=0, keepdims=True)
                for a, x in zip(acc_j, vf_j)] for acc_j, vf_j in zip(acc, vfields)]
        new.append((m_new, l * fix + jnp.sum(p, axis=0, keepdims=True), acc))
    return new


def _empty_state(spec: _Spec):
    vt = spec.tiles(spec.v, False)
    return [(jnp.full((1, 1), NEG_INF, jnp.float32), jnp.zeros((1, 1), jnp.float32),
             [[jnp.zeros((1, wt), jnp.float32) for _, wt, _ in vt] for _ in range(spec.per)])
            for _ in range(spec.G)]


def _store_state(spec: _Spec, state, m_ref, l_ref, a_ref):
    vt = spec.tiles(spec.v, False)
    for g, (m, l, acc) in enumerate(state):
        m_ref[pl.ds(g, 1), :] = m
        l_ref[pl.ds(g, 1), :] = l
        for j in range(spec.per):
            for (w0, wt, _), a in zip(vt, acc[j]):
                a_ref[pl.ds(g, 1), pl.ds(j * spec.P + w0, wt)] = a


def _split_refs(spec: _Spec, refs):
    """The kernel's refs by role: q, keys, values, pick, dist, slopes, rope, outputs."""
    it = iter(refs)
    take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
    q, = take(1)
    k, v = take(spec.n_arrays(spec.k)), take(spec.n_arrays(spec.v))
    pick, = take(1)
    dist, slopes = take(2) if spec.alibi else (None, None)
    rope = take(4) if spec.rope else None
    outs = take(3)
    return q, k, v, pick, dist, slopes, rope, outs, list(it)


class _Loads(NamedTuple):
    k: object
    v: object
    q: object
    rope: object
    pick: object
    dist: object
    slope: object


def _loads(spec, q, k, v, pick, dist, slopes, rope, rows, scale_row, rope_row):
    """Loaders over refs for one block: ``rows`` slices the block's slots out of a per-slot ref
    (a full-L ref on Triton, the block itself on TPU); ``scale_row`` and ``rope_row`` the
    block's row of KIVI's per-channel scales and of the block rotation table."""
    def side(refs):
        def arr(i, c0, w, row):
            return refs[i][scale_row if row else rows, pl.ds(c0, w)]
        return arr

    def rot(i, c0, w):  # cos (i = 0) or sin (1) of the block's slots, [bk, w]
        cols = pl.ds(c0, w)
        c, s = rope[0][rope_row, cols], rope[1][rope_row, cols]  # [1, w]
        ct, st = rope[2][:, cols], rope[3][:, cols]  # [bk, w]
        # cos(a + b) = cos a cos b - sin a sin b; sin(a + b) = sin a cos b + cos a sin b
        return c * ct - s * st if i == 0 else s * ct + c * st

    return _Loads(side(k), side(v),
                  lambda r, g, c0, w: q[pl.ds(r * spec.G + g, 1), pl.ds(c0, w)],
                  rot if spec.rope else None,
                  lambda: pick[rows, :],
                  (lambda: dist[rows, :]) if spec.alibi else None,
                  (lambda g: slopes[pl.ds(g, 1), :]) if spec.alibi else None)


def _triton_kernel(*refs, spec: _Spec):
    q, k, v, pick, dist, slopes, rope, (m_ref, l_ref, a_ref), _ = _split_refs(spec, refs)
    split = pl.program_id(1)

    def body(jb, state):
        b = split * spec.nbs + jb
        start = jnp.minimum(b * spec.bk, spec.L - spec.bk)
        # KIVI's scales are per `group` == bk slots, and L is a multiple of it: the block's
        # start is its row; the rotation table has a row per block.
        ld = _loads(spec, q, k, v, pick, dist, slopes, rope, pl.ds(start, spec.bk),
                    pl.ds(start // spec.bk, 1), pl.ds(b, 1))
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (spec.bk, 1), 0)
        return _block(spec, ld, slot >= b * spec.bk, state)

    state = jax.lax.fori_loop(0, spec.nbs, body, _empty_state(spec))
    _store_state(spec, state, m_ref, l_ref, a_ref)


def _tpu_kernel(*refs, spec: _Spec):
    q, k, v, pick, dist, slopes, rope, (m_ref, l_ref, a_ref), scratch = _split_refs(spec, refs)
    m_s, l_s, a_s = scratch
    jb = pl.program_id(2)
    b = pl.program_id(1) * spec.nbs + jb

    @pl.when(jb == 0)
    def _():
        _store_state(spec, _empty_state(spec), m_s, l_s, a_s)

    vt = spec.tiles(spec.v, False)
    state = [(m_s[pl.ds(g, 1), :], l_s[pl.ds(g, 1), :],
              [[a_s[pl.ds(g, 1), pl.ds(j * spec.P + w0, wt)] for w0, wt, _ in vt]
               for j in range(spec.per)]) for g in range(spec.G)]
    rows = slice(None)
    ld = _loads(spec, q, k, v, pick, dist, slopes, rope, rows, pl.ds(0, 1), pl.ds(0, 1))
    slot = b * spec.bk + jax.lax.broadcasted_iota(jnp.int32, (spec.bk, 1), 0)
    _store_state(spec, _block(spec, ld, slot < spec.L, state), m_s, l_s, a_s)

    @pl.when(jb == spec.nbs - 1)
    def _():
        m_ref[...], l_ref[...], a_ref[...] = m_s[...], l_s[...], a_s[...]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(k: Layout, v: Layout, D: int, rope: bool, L: int, bk: int) -> Optional[str]:
    """Why the kernel cannot take these slots (None: it can). The Triton lowering needs every
    block dimension a power of two; rotation needs whole tiles in each half of the head."""
    if k.per != v.per:
        return f"keys and values packed differently ({k.per} and {v.per} codes a word)"
    if not _power_of_two(D):
        return f"head dim {D} is not a power of two"
    if not _power_of_two(bk) or L < bk:
        return f"block {bk} must be a power of two no larger than the slots ({L})"
    if k.kind == "channel" and k.group != bk:
        return f"per-channel scales over {k.group} slots need blocks of {k.group} slots"
    for lay, halves in ((k, rope), (v, False)):
        span = D // 2 if halves else D
        width = min(lay.channel_group(D), span)
        if span % width or width % lay.per or not _power_of_two(width // lay.per):
            return (f"{lay.kind} {lay.bits}-bit groups of {lay.channel_group(D)} channels do "
                    f"not tile head dim {D} in whole words")
        if lay.channel_group(D) % width:
            return f"groups of {lay.channel_group(D)} channels straddle the head's halves"
    return None


@functools.partial(jax.jit, static_argnames=("k_layout", "v_layout", "splits", "bk", "backend",
                                             "interpret"))
def partials(q: Float[Array, "n rq g d"], keys: tuple, values: tuple,
             pick: Int[Array, "b l"], dist: Optional[Int[Array, "b l"]] = None,
             slopes: Optional[Float[Array, "n g"]] = None, rope: Optional[Rope] = None, *,
             k_layout: Layout, v_layout: Layout, splits: int, bk: int,
             backend: str = "triton", interpret: bool = False):
    """The online-softmax state of each split of the slots: ``(m, l [N, splits, G],
    acc [N, splits, G, D])``, acc in the permuted channel order.

    q [N, Rq, G, D] float32: the query rows (sequence x KV head) at Rq rotations, G query heads
    per KV head, scaled by 1/sqrt(D) and permuted (:func:`permute`); ``keys``, ``values``: the
    sides' arrays (:class:`Layout`); ``pick`` [B, L] int32 (N = B·KVH): the rotation that
    scores each slot, -1 for a slot not attended to; ``dist`` [B, L] and ``slopes`` [N, G]:
    ALiBi's bias -slope·dist (None: none); ``rope``: rotate the keys after dequantizing
    (:class:`Rope`, None: keys as stored)."""
    N, Rq, G, D = q.shape
    B, L = pick.shape
    KVH = N // B
    spec = _Spec(k_layout, v_layout, D, G, Rq, L, bk, -(-(-(-L // bk)) // splits),
                 rope is not None, dist is not None)
    why = supports(k_layout, v_layout, D, rope is not None, L, bk)
    _check(why is None, f"the stored-format decode kernel cannot take this cache: {why}")
    _check(N == B * KVH and keys[0].shape[:2] == (N, L) and values[0].shape[:2] == (N, L),
           f"keys and values must be [N={N}, L={L}, ...] for pick [B={B}, L]; got "
           f"{keys[0].shape} and {values[0].shape}")
    qf = q.astype(jnp.float32).reshape(N, Rq * G, D)
    # (array, per sequence?, per block?) in the kernel's order
    args = [(qf, False)] + [(a, False) for a in (*keys, *values)]
    args.append((pick.astype(jnp.int32)[..., None], True))
    if dist is not None:
        args += [(dist.astype(jnp.int32)[..., None], True),
                 (slopes.astype(jnp.float32).reshape(N, G, 1), False)]
    if rope is not None:
        args += [(a, True) for a in _tables(rope, L, bk, backend == "triton", spec.per)]
    out_shape = [jax.ShapeDtypeStruct((N, splits, G, 1), jnp.float32),
                 jax.ShapeDtypeStruct((N, splits, G, 1), jnp.float32),
                 jax.ShapeDtypeStruct((N, splits, G, D), jnp.float32)]
    nbytes = sum(a.size * a.dtype.itemsize for a in (*keys, *values))
    cost = pl.CostEstimate(flops=4 * N * Rq * G * L * D, transcendentals=N * G * L,
                           bytes_accessed=nbytes + 4 * N * splits * G * (D + 2))
    row = lambda n, per_seq: jax.lax.div(n, KVH) if per_seq else n  # noqa: E731
    if backend == "triton":
        from jax.experimental.pallas import triton as pl_triton
        # Each program sees its row's whole arrays and walks its blocks (pl.ds in the kernel).
        spec_of = lambda a, per_seq: pl.BlockSpec(  # noqa: E731
            (None,) + a.shape[1:], lambda n, s: (row(n, per_seq),) + (0,) * (a.ndim - 1))
        out = pl.pallas_call(
            functools.partial(_triton_kernel, spec=spec), grid=(N, splits),
            in_specs=[spec_of(a, ps) for a, ps in args],
            out_specs=[pl.BlockSpec((None, None, G, o.shape[3]), lambda n, s: (n, s, 0, 0))
                       for o in out_shape],
            out_shape=out_shape, interpret=interpret, cost_estimate=cost,
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        )(*(a for a, _ in args))
    elif backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        nbs = spec.nbs

        def spec_of(a, per_seq, blocked):
            if not blocked:  # q, slopes, the in-block rotation table: whole, per row
                return pl.BlockSpec((None,) + a.shape[1:],
                                    lambda n, s, j: (row(n, per_seq),) + (0,) * (a.ndim - 1))
            # (past the last block: the last again, its slots masked as past L)
            last = -(-L // bk) - 1
            blk = lambda n, s, j: (row(n, per_seq), jnp.minimum(s * nbs + j, last))  # noqa
            if a.shape[1] == L:  # per slot: bk rows
                return pl.BlockSpec((None, bk, a.shape[2]), lambda n, s, j: (*blk(n, s, j), 0))
            # per block (a unit axis added below: Mosaic takes a [1, w] block of [1, w])
            return pl.BlockSpec((None, None, 1, a.shape[2]),
                                lambda n, s, j: (*blk(n, s, j), 0, 0))

        blocked = [False] + [True] * (len(keys) + len(values)) + [True]
        if dist is not None:
            blocked += [True, False]
        if rope is not None:
            blocked += [True, True, False, False]
        out = pl.pallas_call(
            functools.partial(_tpu_kernel, spec=spec), grid=(N, splits, nbs),
            in_specs=[spec_of(a, ps, bl) for (a, ps), bl in zip(args, blocked)],
            out_specs=[pl.BlockSpec((None, None, G, o.shape[3]), lambda n, s, j: (n, s, 0, 0))
                       for o in out_shape],
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                            pltpu.VMEM((G, D), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=pltpu.InterpretParams() if interpret else False, cost_estimate=cost,
        )(*(a if not bl or a.shape[1] == L else a[:, :, None]
            for (a, _), bl in zip(args, blocked)))
    else:
        raise ValueError(f"unknown Pallas backend {backend!r}; use triton or tpu")
    m, l, acc = out
    return m[..., 0], l[..., 0], acc


def merge(m: Float[Array, "... s g"], l: Float[Array, "... s g"],
          acc: Float[Array, "... s g d"], axis: int = -2):
    """Online-softmax states combined over ``axis`` of m and l (the splits) -> (m, l, acc)
    without that axis: the state of all their slots together."""
    M = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.exp(m - M)
    acc_axis = axis - 1 if axis < 0 else axis  # acc has one more (trailing) axis
    return (jnp.squeeze(M, axis), jnp.sum(l * w, axis=axis),
            jnp.sum(acc * w[..., None], axis=acc_axis))
