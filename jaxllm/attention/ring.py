"""A chunk of tokens through a StreamingLLM cache (sink slots + a ring; a window cache has no
sinks, a dense one never wraps): the chunk attends to the sinks, to the ring as it was before
the chunk, and to itself, all at positions within the cache ("Efficient Streaming Language
Models with Attention Sinks", Xiao et al. 2024, Section 3.2: positions are assigned within the
cache, not in the original text). jaxllm.kv.cache's chunk_layout does the index arithmetic.

Three segments of keys (jaxllm.attention.flash), each with its own positions: the sinks, seen
from the query's position min(t, S+W-1); the ring's slots at -d (d tokens before the chunk);
the chunk's keys at their offsets, causal and within the window."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ..config import ModelConfig
from ..kv import cache as kvc
from ..kv import stores
from ..rope import Rotation, apply_rope, model_rotation
from ..rope import rotation as plain_rotation
from . import flash
from . import scores as sc


class Ring(NamedTuple):
    lay: kvc.ChunkLayout
    q: Rotation  # the chunk's queries, for the ring and chunk keys [B, T]
    keys: Rotation  # the ring's slots then the chunk's keys [B, C + T]
    mask: Bool[Array, "b t l"]  # [B, T, S + C + T] (the materialised form's)
    q_sink: Optional[Rotation] = None  # queries at min(t, S+W-1), for the sink keys
    k_sink: Optional[Rotation] = None  # sink keys at 0..S-1
    store: Optional[Rotation] = None  # the chunk's keys at their slots' positions (keys_rotated)

    def attend(self, q, k, v, layer_cache, cfg: ModelConfig, int8_att=None,
               keep_probs: bool = False):
        """q [B, T, H, Dh], k, v [B, KVH, T, Dh] and the layer's (keys, values) -> (out
        [B, T, H, Dh] float32, the layer's new (keys, values), None)."""
        lay = self.lay
        ck, cv = layer_cache  # float arrays, or quantized stores (jaxllm.kv.quantized)
        if self.store is not None:  # the cache keeps keys rotated at their slots' positions
            k = apply_rope(k, self.store, head_major=True)
        k_new, v_new = k, v
        T = q.shape[1]
        S = 0 if self.k_sink is None else self.k_sink.pos.shape[1]
        # What is attended to is exactly what is cached (its dtype, its quantization), so a
        # chunk and the token-by-token process see identical keys and values.
        k_ring, v_ring = stores.as_stored(ck, k), stores.as_stored(cv, v)
        C = lay.ring_k_pos.shape[1]
        ring_rot, chunk_rot = self.keys.part(0, C), self.keys.part(C, C + T)
        if int8_att is not None or flash.backend(cfg.kernels.attention) == "materialised":
            ck, cv = stores.read(ck, lay), stores.read(cv, lay)
            scores = [sc.part_scores(q, self.q, ck, ring_rot, cfg, int8_att),
                      sc.part_scores(q, self.q, k_ring, chunk_rot, cfg, int8_att)]
            values = [cv, v_ring]
            if S:
                k, v = k.astype(ck.dtype), v.astype(cv.dtype)  # sinks: full precision
                scores.insert(0, sc.part_scores(q, self.q_sink, kvc.merge_sinks(ck, k, lay, S),
                                                self.k_sink, cfg, int8_att))
                values.insert(0, kvc.merge_sinks(cv, v, lay, S))
            out = sc.attend(scores, values, self.mask, cfg, int8_att)[0]
            return out, (kvc.write_layer(layer_cache[0], k_new, lay),
                         kvc.write_layer(layer_cache[1], v_new, lay)), None
        # Blockwise (jaxllm.attention.flash): the ring is read a block at a time, as stored
        # (a bfloat16 cache on CPU as its bits), and rotated a block at a time.
        ck, cv = stores.raw(ck, lay), stores.raw(cv, lay)
        W = C - S
        span = min(W, cfg.sliding_window) if cfg.sliding_window else W
        segs = [flash.Segment(q, ck, cv, lay.rest_q_pos, lay.ring_k_pos, lay.ring_ok, span,
                              self.q, ring_rot),
                flash.Segment(q, k_ring, v_ring, lay.rest_q_pos, lay.chunk_k_pos, lay.chunk_ok,
                              span, self.q, chunk_rot)]
        if S:  # the sinks are never out of the window; visible once written (j <= position)
            read = lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16) \
                if a.dtype == jnp.uint16 else a
            sink_k, sink_v = (read(a[:, :, :S]) for a in (ck, cv))
            k, v = k.astype(sink_k.dtype), v.astype(sink_v.dtype)  # sinks: full precision
            segs.insert(0, flash.Segment(q, kvc.merge_sinks(sink_k, k, lay, S),
                                         kvc.merge_sinks(sink_v, v, lay, S), lay.sink_q_pos,
                                         self.k_sink.pos, lay.sink_ok, None, self.q_sink,
                                         self.k_sink))
        out, kvs = flash.attend(segs, sc.model_slopes(cfg), cfg.sink == "zero",
                                cfg.kernels.attention, threaded=True)
        # Written into the arrays the attention's loops hand back (flash.attend's note), and
        # after the output. Where the loops run once (a ring of one key block: SmolLM2's 1,024
        # slots) XLA removes them, so nothing orders the write after the reads of the ring, and
        # XLA copied every layer's keys and values before the write and back into the donated
        # cache after generate's loop: 120 copies of 0.75 MiB a call. An optimization barrier
        # does not order them on XLA:CPU; a value the write needs does: the written keys and
        # values plus an exact zero made from the output (0 x a NaN or an infinity -> 0 too).
        ring_k, ring_v = kvs[-2]
        zero = jnp.zeros((), jnp.float32) * out.reshape(-1)[0].astype(jnp.float32)
        zero = jnp.where(jnp.isnan(zero), 0.0, zero)
        k_new, v_new = k_new + zero.astype(k_new.dtype), v_new + zero.astype(v_new.dtype)
        return out, (kvc.write_layer(stores.holding(layer_cache[0], ring_k), k_new, lay),
                     kvc.write_layer(stores.holding(layer_cache[1], ring_v), v_new, lay)), None


def plan(cfg: ModelConfig, lay: kvc.ChunkLayout, B: int, T: int, sinks: int, freq,
         keys_rotated: bool = False) -> Ring:
    """The chunk's positions: queries at their chunk offsets c, ring keys at -d, chunk keys at
    c'; ``keys_rotated``: the cache stores keys rotated at their slots' positions
    (jaxllm.kv.cache's note), which are turned to these by the difference."""
    rotation = lambda pos: model_rotation(cfg, pos, freq)
    store = rotation(lay.store_pos) if keys_rotated else None
    C = lay.ring_k_pos.shape[1]
    k_pos = jnp.concatenate([lay.ring_k_pos, lay.chunk_k_pos], axis=1)
    mask = lay.rest_mask & sc.within_window(lay.rest_q_pos, k_pos, cfg)
    if keys_rotated:  # a rotation by the difference, unscaled (YaRN's scale is in the keys)
        keys = plain_rotation(k_pos - jnp.concatenate(
            [jnp.broadcast_to(kvc.slot_positions(sinks, C - sinks), (B, C)), lay.store_pos], 1),
            freq)
    else:
        keys = rotation(k_pos)
    ring = Ring(lay, rotation(lay.rest_q_pos), keys, mask, store=store)
    if not sinks:
        return ring
    sink_pos = jnp.broadcast_to(jnp.arange(sinks), (B, sinks))
    k_sink = Rotation(sink_pos) if keys_rotated else rotation(sink_pos)  # stored at j
    return ring._replace(q_sink=rotation(lay.sink_q_pos), k_sink=k_sink,
                         mask=jnp.concatenate([lay.sink_mask, mask], axis=-1))
