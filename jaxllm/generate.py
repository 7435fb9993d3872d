"""Generation: prefill + decode in one jit (``lax.while_loop``, cache donated), and a Python twin."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .cache import KVCache
from .config import ModelConfig
from .model import _forward, check_chunk, forward


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. ``temperature=0`` is greedy; top-k/top-p filter before sampling."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos_id: Optional[int] = None  # stop a row after it emits this token

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


class GenerateResult(NamedTuple):
    tokens: Int[Array, "b n"]  # generated ids; after a row's EOS, padded with eos_id
    num_tokens: Int[Array, " b"]  # tokens generated per row (EOS included)
    cache: KVCache  # holds the prompt and every generated token: pass it to the next call


def sample_logits(logits: Float[Array, "b v"], key: jax.Array, sc: SamplingConfig
                  ) -> Int[Array, " b"]:
    """Greedy, or temperature sampling restricted to the top-k and the top-p nucleus."""
    if sc.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sc.temperature
    if sc.top_k:
        kth = jax.lax.top_k(logits, min(sc.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sc.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p: a token stays if
        # the mass strictly before it (in descending order) is below top_p.
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), -1)
        before = jnp.cumsum(probs, -1) - probs
        keep_sorted = before < sc.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
            keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _sink_first(cfg: ModelConfig, prompt, cache: KVCache, prompt_lengths):
    """A learnable-sink model starts every stream with its sink token: rows whose cache is still
    empty get it in front of their prompt (other rows continue their stream unchanged)."""
    fresh = np.asarray(jax.device_get(cache.length)) == 0  # [B]
    B, P = prompt.shape
    lens = np.asarray(jax.device_get(prompt_lengths))
    shifted = jnp.concatenate([jnp.full((B, 1), cfg.sink_id, jnp.int32), prompt], 1)
    padded = jnp.concatenate([prompt, jnp.zeros((B, 1), jnp.int32)], 1)
    return (jnp.where(jnp.asarray(fresh)[:, None], shifted, padded),
            jnp.asarray(lens + fresh, jnp.int32))


def _check_generate(cfg, prompt, cache, prompt_lengths, sc):
    lens = check_chunk(cfg, prompt, cache, prompt_lengths)
    lens_np = np.asarray(jax.device_get(lens))
    if (lens_np < 1).any():
        raise ValueError("every row needs at least one prompt token (prompt_lengths >= 1): the "
                         "first generated token is sampled from the last prompt token's logits")
    if not cache.evict:
        need = np.asarray(jax.device_get(cache.length)) + lens_np + sc.max_new_tokens
        if (need > cache.capacity).any():
            raise ValueError(f"dense cache overflow: prompt + max_new_tokens needs {int(need.max())}"
                             f" slots but the cache has {cache.capacity}; use a larger dense cache "
                             f"or a streaming cache (init_cache(cfg, B, sinks=4, window=W))")
    return lens


@functools.partial(jax.jit, static_argnames=("cfg", "sc"), donate_argnames=("cache",))
def _generate_jit(params, cfg: ModelConfig, sc: SamplingConfig, prompt, lens, cache, key):
    B, N = prompt.shape[0], sc.max_new_tokens
    eos = -1 if sc.eos_id is None else sc.eos_id
    logits, cache = _forward(params, cfg, prompt, cache, lens)
    key, sub = jax.random.split(key)
    tok = sample_logits(logits[jnp.arange(B), lens - 1], sub, sc)
    out = jnp.full((B, N), max(eos, 0), jnp.int32).at[:, 0].set(tok)

    # pending: the row has a sampled token not yet written to the cache. Every sampled token,
    # EOS included, is written, so the returned cache continues the conversation exactly.
    init = dict(i=jnp.int32(1), tok=tok, pending=jnp.ones((B,), bool), done=tok == eos,
                count=jnp.ones((B,), jnp.int32), out=out, key=key, cache=cache)

    def body(s):
        logits, cache = _forward(params, cfg, s["tok"][:, None], s["cache"],
                                 s["pending"].astype(jnp.int32))
        key, sub = jax.random.split(s["key"])
        new = sample_logits(logits[:, 0], sub, sc)
        can = s["pending"] & ~s["done"] & (s["i"] < N)
        col = jax.lax.dynamic_index_in_dim(s["out"], jnp.minimum(s["i"], N - 1), 1, False)
        out = jax.lax.dynamic_update_index_in_dim(s["out"], jnp.where(can, new, col),
                                                  jnp.minimum(s["i"], N - 1), 1)
        return dict(i=s["i"] + 1, tok=jnp.where(can, new, s["tok"]), pending=can,
                    done=s["done"] | (can & (new == eos)), count=s["count"] + can, out=out,
                    key=key, cache=cache)

    s = jax.lax.while_loop(lambda s: jnp.any(s["pending"]), body, init)
    return GenerateResult(s["out"], s["count"], s["cache"])


def generate(params, cfg: ModelConfig, prompt: Int[Array, "b p"], cache: KVCache,
             sampling: SamplingConfig = SamplingConfig(), key: Optional[jax.Array] = None,
             prompt_lengths: Optional[Int[Array, " b"]] = None) -> GenerateResult:
    """Feed ``prompt`` (right-padded to ``prompt_lengths``) and generate up to
    ``sampling.max_new_tokens`` tokens per row, all in one compiled loop.

    A learnable-sink model (``cfg.sink == "learnable"``) gets its sink token in front of the
    prompt of every row whose cache is empty. The cache is donated: do not reuse the cache you passed in; use ``result.cache``, which holds
    the prompt and all generated tokens, so the next round of a chat is ``generate(params, cfg,
    next_prompt, result.cache, ...)``.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    lens = _check_generate(cfg, prompt, cache, prompt_lengths, sampling)
    if cfg.sink_id is not None:  # one more token to fit (and check) in the cache
        prompt, lens = _sink_first(cfg, prompt, cache, lens)
        lens = _check_generate(cfg, prompt, cache, lens, sampling)
    key = jax.random.key(0) if key is None else key
    return _generate_jit(params, cfg, sampling, prompt, lens, cache, key)


def generate_python(params, cfg: ModelConfig, prompt, cache: KVCache,
                    sampling: SamplingConfig = SamplingConfig(), key=None, prompt_lengths=None
                    ) -> GenerateResult:
    """The same algorithm as :func:`generate` as a plain Python loop over :func:`forward`
    (one step at a time, easy to step through in a debugger; also the test oracle)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    lens = _check_generate(cfg, prompt, cache, prompt_lengths, sampling)
    if cfg.sink_id is not None:  # one more token to fit (and check) in the cache
        prompt, lens = _sink_first(cfg, prompt, cache, lens)
        lens = _check_generate(cfg, prompt, cache, lens, sampling)
    key = jax.random.key(0) if key is None else key
    B, N = prompt.shape[0], sampling.max_new_tokens
    eos = -1 if sampling.eos_id is None else sampling.eos_id
    logits, cache = forward(params, cfg, prompt, cache, lens)
    key, sub = jax.random.split(key)
    tok = np.asarray(sample_logits(logits[jnp.arange(B), lens - 1], sub, sampling))
    rows = [[int(t)] for t in tok]
    pending, done = np.ones(B, bool), tok == eos
    i = 1
    while pending.any():
        logits, cache = forward(params, cfg, jnp.asarray(tok)[:, None], cache,
                                jnp.asarray(pending, jnp.int32))
        key, sub = jax.random.split(key)
        new = np.asarray(sample_logits(logits[:, 0], sub, sampling))
        can = pending & ~done & (i < N)
        for b in np.flatnonzero(can):
            rows[b].append(int(new[b]))
        tok = np.where(can, new, tok)
        done |= can & (new == eos)
        pending, i = can, i + 1
    out = np.full((B, N), max(eos, 0), np.int32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return GenerateResult(jnp.asarray(out), jnp.asarray([len(r) for r in rows], jnp.int32), cache)
