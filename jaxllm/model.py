"""The transformer: Flax modules that take the KV cache as an argument and return the new one."""
from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from . import cache as kvc
from .config import ModelConfig
from .rope import apply_rope

NEG_INF = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


class Linear(nn.Module):
    """y = x @ kernel (+ bias); kernel [in, out]. Params stay float32, compute in ``dtype``."""

    features: int
    use_bias: bool
    std: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(self.std),
                            (x.shape[-1], self.features))
        y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
        return y


class Norm(nn.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale only), computed in float32."""

    kind: str
    eps: float

    @nn.compact
    def __call__(self, x):
        xf = x.astype(jnp.float32)
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if self.kind == "rmsnorm":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps) * scale
        else:
            mu = jnp.mean(xf, -1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
            y = (xf - mu) * jax.lax.rsqrt(var + self.eps) * scale
            y = y + self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        return y.astype(x.dtype)


def _attend(scores_parts, value_parts, mask, cfg: ModelConfig):
    """softmax over the concatenated key axis, then the weighted sum of values (GQA-aware).

    scores_parts: [B, KVH, G, T, L_i] each; value_parts: [B, L_i, KVH, Dh]; mask [B, T, sum L_i].
    Only the (small) scores are concatenated; keys and values stay where they are, so a decode
    step never copies the cache.
    """
    scores = jnp.concatenate(scores_parts, axis=-1) if len(scores_parts) > 1 else scores_parts[0]
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out, start = 0.0, 0
    for v in value_parts:
        p = probs[..., start:start + v.shape[1]]
        out = out + jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32))
        start += v.shape[1]
    B, T = out.shape[:2]
    return out.reshape(B, T, cfg.num_heads, cfg.head_dim)  # [B, T, H, Dh]


def _scores(q, k, cfg: ModelConfig):
    """q [B, T, H, Dh], k [B, L, KVH, Dh] -> [B, KVH, G, T, L] in float32, scaled."""
    B, T = q.shape[:2]
    G = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(B, T, cfg.num_kv_heads, G, cfg.head_dim).astype(jnp.float32)
    return jnp.einsum("btkgh,bskh->bkgts", q, k.astype(jnp.float32)) / math.sqrt(cfg.head_dim)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, lay: Optional[kvc.ChunkLayout], sinks: int):
        cfg = self.cfg
        B, T, _ = x.shape
        dt = _dtype(cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        dense = lambda n, name, std=cfg.init_std: Linear(n, cfg.attn_bias, std, dt, name=name)
        q = dense(cfg.num_heads * cfg.head_dim, "q")(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = dense(cfg.num_kv_heads * cfg.head_dim, "k")(x).reshape(
            B, T, cfg.num_kv_heads, cfg.head_dim)
        v = dense(cfg.num_kv_heads * cfg.head_dim, "v")(x).reshape(
            B, T, cfg.num_kv_heads, cfg.head_dim)
        rope = lambda t, pos: apply_rope(t, pos, cfg.rotary_dim, cfg.rope_theta)

        if lay is None:  # plain causal forward, positions 0..T-1
            pos = jnp.broadcast_to(jnp.arange(T), (B, T))
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
            ctx = _attend([_scores(rope(q, pos), rope(k, pos), cfg)], [v], mask, cfg)
            new_cache = None
        else:
            ck, cv = layer_cache
            # What is attended to is exactly what is cached (same dtype), so a chunk and the
            # token-by-token process see identical keys even with a bfloat16 cache.
            k, v = k.astype(ck.dtype), v.astype(cv.dtype)
            q_rest = rope(q, lay.rest_q_pos)
            scores = [_scores(q_rest, rope(ck[:, sinks:], lay.ring_k_pos), cfg),  # [B,..,T,W]
                      _scores(q_rest, rope(k, lay.chunk_k_pos), cfg)]  # this chunk: [B,..,T,T]
            values, mask = [cv[:, sinks:], v], lay.rest_mask
            if sinks:
                sink_k = kvc.merge_sinks(ck, k, lay, sinks)  # [B, S, KVH, Dh]
                sink_v = kvc.merge_sinks(cv, v, lay, sinks)
                sink_pos = jnp.broadcast_to(jnp.arange(sinks), (B, sinks))
                scores.insert(0, _scores(rope(q, lay.sink_q_pos), rope(sink_k, sink_pos), cfg))
                values.insert(0, sink_v)
                mask = jnp.concatenate([lay.sink_mask, mask], axis=-1)
            else:
                sink_k = sink_v = ck[:, :0]
            ctx = _attend(scores, values, mask, cfg)
            new_cache = (kvc.write_chunk(ck, sink_k, k, lay, sinks),
                         kvc.write_chunk(cv, sink_v, v, lay, sinks))
        ctx = ctx.reshape(B, T, cfg.num_heads * cfg.head_dim).astype(dt)
        return Linear(cfg.hidden_size, cfg.attn_bias, out_std, dt, name="o")(ctx), new_cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.cfg, _dtype(self.cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        if cfg.mlp == "swiglu":
            gate = Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt, name="gate")(x)
            up = Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt, name="up")(x)
            h = jax.nn.silu(gate) * up
        else:
            h = jax.nn.gelu(Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt,
                                   name="up")(x), approximate=False)
        return Linear(cfg.hidden_size, cfg.mlp_bias, out_std, dt, name="down")(h)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, lay, sinks: int):
        cfg = self.cfg
        ln1 = Norm(cfg.norm, cfg.norm_eps, name="ln_attn")
        ln2 = Norm(cfg.norm, cfg.norm_eps, name="ln_mlp")
        attn, new_cache = Attention(cfg, name="attn")(ln1(x), layer_cache, lay, sinks)
        if cfg.parallel_residual:  # x + Attn(LN1 x) + MLP(LN2 x)
            return x + attn + MLP(cfg, name="mlp")(ln2(x)), new_cache
        h = x + attn
        return h + MLP(cfg, name="mlp")(ln2(h)), new_cache


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, cache: Optional[kvc.KVCache], lay: Optional[kvc.ChunkLayout]):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size,
                         embedding_init=nn.initializers.normal(cfg.init_std), name="embed")
        x = embed(tokens).astype(_dtype(cfg))
        new_k, new_v = [], []
        for layer in range(cfg.num_layers):
            layer_cache = None if cache is None else (cache.k[layer], cache.v[layer])
            x, nc = Block(cfg, name=f"layer_{layer}")(
                x, layer_cache, lay, 0 if cache is None else cache.sinks)
            if nc is not None:
                new_k.append(nc[0])
                new_v.append(nc[1])
        x = Norm(cfg.norm, cfg.norm_eps, name="ln_final")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x.astype(jnp.float32))
        else:
            logits = Linear(cfg.vocab_size, False, cfg.init_std, _dtype(cfg), name="lm_head")(x)
        return logits.astype(jnp.float32), (tuple(new_k), tuple(new_v))


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Random parameters (normal(init_std), output projections scaled by 1/sqrt(2L))."""
    return Transformer(cfg).init(key, jnp.zeros((1, 1), jnp.int32), None, None)["params"]


def _forward(params, cfg: ModelConfig, tokens, cache, lens):
    if cache is None:
        logits, _ = Transformer(cfg).apply({"params": params}, tokens, None, None)
        return logits, None
    lay = kvc.chunk_layout(cache, lens, tokens.shape[1])
    logits, (ks, vs) = Transformer(cfg).apply({"params": params}, tokens, cache, lay)
    # A dense cache asked to overflow: under jit we cannot raise, so the row's logits become NaN
    # (outside jit, forward() raises before getting here).
    logits = jnp.where(lay.overflow[:, None, None], jnp.nan, logits)
    new_cache = cache.replace(k=ks, v=vs, length=lay.new_length, head=lay.new_head)
    return logits, new_cache


_forward_jit = jax.jit(_forward, static_argnames=("cfg",))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_chunk(cfg: ModelConfig, tokens, cache: Optional[kvc.KVCache], lengths) -> jax.Array:
    """Validate a forward call's inputs; returns per-row valid lengths [B] (int32)."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    B, T = tokens.shape
    if lengths is None:
        lens = jnp.full((B,), T, jnp.int32)
    else:
        lens = jnp.asarray(lengths, jnp.int32)
        if lens.shape != (B,):
            raise ValueError(f"lengths must have shape [batch]=({B},), got {tuple(lens.shape)}")
        if _is_concrete(lens):
            lo, hi = int(lens.min()), int(lens.max())
            if lo < 0 or hi > T:
                raise ValueError(f"lengths must lie in [0, {T}] (valid tokens per row of this "
                                 f"chunk), got values in [{lo}, {hi}]")
    if cache is None:
        if lengths is not None:
            raise ValueError("lengths (right padding) only applies to a forward with a cache; "
                             "a plain causal forward is unaffected by trailing padding")
        return lens
    if cache.batch != B:
        raise ValueError(f"tokens have batch {B} but the cache was made for batch {cache.batch}; "
                         f"use init_cache(cfg, batch={B}, ...)")
    if cache.k[0].shape[2:] != (cfg.num_kv_heads, cfg.head_dim) or len(cache.k) != cfg.num_layers:
        raise ValueError("the cache does not match this ModelConfig (layers/kv heads/head dim); "
                         "make it with init_cache(cfg, ...) for the same cfg")
    if not cache.evict and _is_concrete(cache.length) and _is_concrete(lens):
        need = jax.device_get(cache.length + lens)
        if (need > cache.capacity).any():
            raise ValueError(f"dense cache overflow: a row would hold {int(need.max())} tokens but "
                             f"the cache has {cache.capacity} slots; make a larger dense cache or "
                             f"use a streaming cache (init_cache(cfg, B, sinks=4, window=W))")
    return lens


def forward(params, cfg: ModelConfig, tokens: Int[Array, "b t"],
            cache: Optional[kvc.KVCache] = None, lengths: Optional[Int[Array, " b"]] = None
            ) -> tuple[Float[Array, "b t v"], Optional[kvc.KVCache]]:
    """Logits for ``tokens`` and the updated cache.

    ``cache=None``: a plain causal forward at positions 0..T-1 (the cache returned is None).
    With a cache: the chunk (any length, also longer than the window) continues each row's
    stream; ``lengths`` [B] marks how many leading tokens of each row are real (the rest is padding,
    never written, with undefined logits). Every token's logits equal those of feeding the stream
    one token at a time through a cache trimmed to S+W after each token.
    """
    tokens = jnp.asarray(tokens)
    lens = check_chunk(cfg, tokens, cache, lengths)
    return _forward_jit(params, cfg, tokens.astype(jnp.int32), cache, lens)
