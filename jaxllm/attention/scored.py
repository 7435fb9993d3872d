"""Attention through an H2O / Q-Hitter cache (jaxllm.kv.evict: "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models", Zhang et al. 2023, Algorithm 1; and
Q-Hitter, "Q-Hitter: A Better Token Oracle for Efficient LLM Inference via Sparse-Quantized KV
Cache", Zhang et al. 2024). Each KV head keeps its own keys at their own ranks, and the
attention paid to every key is what decides evictions, so this form keeps the probabilities:
it is the materialised form (jaxllm.attention.scores), also for a prefill, which attends
fully and compresses once, as the authors do."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from pallas_kernels.reference import computed_once

from ..config import ModelConfig
from ..kv import evict, stores
from ..rope import Rotation, model_rotation
from . import flash
from . import scores as mat


class Scored(NamedTuple):
    lay: evict.Layout
    q: Rotation  # the chunk's queries at their ranks n + c [B, T]
    keys: Rotation  # the chunk's keys, likewise
    mask: Bool[Array, "b t t"]  # causal within the chunk (and Mistral's window)
    table: Rotation  # positions 0..C+T-1 [B, P] and their tables, gathered per head

    def rotate(self, pos) -> Rotation:
        """Per-head key positions [B, KVH, L] -> their Rotation ([B, KVH, L, r/2] tables)."""
        if self.table.cos is None:
            return Rotation(pos)
        rows = jax.vmap(lambda t, i: t[i])  # per batch row: [P, r/2][KVH, L]
        return Rotation(pos, rows(self.table.cos, pos), rows(self.table.sin, pos))

    def attend(self, q, k, v, layer_cache, cfg: ModelConfig, int8_att=None,
               keep_probs: bool = False):
        ctx, new_cache = attend_scored(q, k, v, layer_cache, self, cfg, int8_att)
        return ctx, new_cache, None


def plan(cfg: ModelConfig, lay: evict.Layout, B: int, T: int, freq) -> Scored:
    """Keys at their rank, per head. Each layer and KV head places its keys differently: their
    cos/sin rows are gathered from one table of positions 0..C+T-1 per forward (a row gather;
    cos and sin of every slot in every layer cost more than the rest of the decode step on
    CPU)."""
    P = lay.keep + 1 + T
    table = model_rotation(cfg, jnp.broadcast_to(jnp.arange(P), (B, P)), freq)
    if table.cos is not None:
        table = Rotation(table.pos, computed_once(table.cos), computed_once(table.sin))
    rot = model_rotation(cfg, lay.pos, freq)
    return Scored(lay, rot, rot, lay.chunk_mask & mat.within_window(lay.pos, lay.pos, cfg),
                  table)


def attend_scored(q, k, v, layer_cache, plan: Scored, cfg: ModelConfig, int8_att):
    """Attention through an H2O / Q-Hitter cache (jaxllm.kv.evict): each KV head's kept keys sit
    at their own ranks; the attention paid to every key is added to its score, then the cache
    evicts (one token per decode step, or compresses after a chunk)."""
    lay = plan.lay
    ck, cv, sc = layer_cache
    B, T = q.shape[:2]
    spec, S = lay.spec, lay.sinks
    if spec.uses_error:  # Q-Hitter: what storing each key and value loses
        err = jnp.stack([evict.token_error(x, functools.partial(stores.as_stored, store))
                         for x, store in ((k, ck), (v, cv))], -1)
    else:
        err = jnp.zeros(k.shape[:3] + (2,))
    err = jnp.where((lay.pos < S)[:, None, :, None], 0.0, err)  # sinks stay in full precision

    def cache_scores(keys, sc):
        s = mat.part_scores(q, plan.q, keys, plan.rotate(sc.rank), cfg, int8_att)
        ok = sc.rank >= 0  # [B, KVH, C1]
        if cfg.sliding_window:
            ok = ok & (lay.pos[:, None, :, None] - sc.rank[:, :, None, :] < cfg.sliding_window)
            ok = ok[:, :, None]  # [B, KVH, 1, T, C1]
        else:
            ok = ok[:, :, None, None]
        return jnp.where(ok, s, flash.NEG_INF)

    active = lay.lens > 0
    if T == 1:  # decode: write the token into the free slot, attend over all, evict one
        bi, hi = jnp.meshgrid(jnp.arange(B), jnp.arange(k.shape[1]), indexing="ij")
        slot = jnp.where(active[:, None], sc.free, ck.shape[2])  # out of range: not written

        def scatter(arr, rows):
            return arr.at[bi, hi, slot].set(rows[:, :, 0].astype(arr.dtype), mode="drop")

        ck, cv = stores.write(ck, k, None, scatter), stores.write(cv, v, None, scatter)
        sc = evict.written(sc, lay.n, active, err[:, :, 0])
        keys, values = stores.read(ck, None), stores.read(cv, None)
        C1 = keys.shape[2]
        ctx, probs = mat.attend([cache_scores(keys, sc)], [values], jnp.ones((B, 1, C1), bool),
                             cfg, int8_att)
        sc = evict.decode_update(sc, probs, lay.n, active, spec, S)
        return ctx, (ck, cv, sc)
    # A chunk: attend to what is kept and to its own tokens as they will be stored (a token
    # that becomes a sink stays in full precision), then compress.
    keys, values = stores.read(ck, None), stores.read(cv, None)
    C1 = keys.shape[2]
    sink = (lay.pos < S)[:, None, :, None]
    k_st = jnp.where(sink, k.astype(keys.dtype), stores.as_stored(ck, k))
    v_st = jnp.where(sink, v.astype(values.dtype), stores.as_stored(cv, v))
    parts = [cache_scores(keys, sc), mat.part_scores(q, plan.q, k_st, plan.keys, cfg, int8_att)]
    mask = jnp.concatenate([jnp.ones((B, T, C1), bool), plan.mask], -1)
    ctx, probs = mat.attend(parts, [values, v_st], mask, cfg, int8_att)
    p = jnp.sum(jnp.where(lay.valid[:, None, None, :, None], probs, 0.0), axis=(2, 3))
    sc, idx = evict.compress(sc, p[..., :C1], p[..., C1:], err, lay, spec)
    return ctx, (stores.select(ck, k, idx), stores.select(cv, v, idx), sc)
