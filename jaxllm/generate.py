"""Generation: prefill + decode in one jit (``lax.while_loop``, cache donated), and a Python twin."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .kv.cache import KVCache, available_bytes
from .config import INT32_MAX, ModelConfig
from .model import apply, apply_by_layer, check_chunk, forward
from .positions import with_sink
from .weight_only import loop_weights


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. ``temperature=0`` is greedy; top-k/top-p filter before sampling."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos_id: Optional[int] = None  # stop a row after it emits this token

    def __post_init__(self):
        if not 1 <= self.max_new_tokens <= INT32_MAX:
            raise ValueError(f"max_new_tokens must lie in [1, {INT32_MAX}] (a row's tokens are "
                             f"int32-indexed), got {self.max_new_tokens}")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails >= 0
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def rule(self) -> "SamplingConfig":
        """Only what picks a token (temperature, top-k, top-p): the static argument of the
        step-wise programs, so a different token budget or end token compiles nothing new."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


class GenerateResult(NamedTuple):
    tokens: Int[Array, "b n"]  # generated ids; after a row's EOS, padded with eos_id
    num_tokens: Int[Array, " b"]  # tokens generated per row (EOS included)
    cache: KVCache  # holds the prompt and every generated token: pass it to the next call


def greedy(logits: Float[Array, "... v"]) -> Int[Array, "..."]:
    """``jnp.argmax(logits, -1)`` as int32 (the first maximum, or the first NaN if there is one),
    as a max and then the first index that holds it. XLA:CPU runs argmax's (value, index)
    reduction as a scalar loop, the plain reductions vectorise (docs/CPU.md, "Greedy
    sampling")."""
    V = logits.shape[-1]
    nan = jnp.isnan(logits)
    top = jnp.max(logits, -1, keepdims=True)  # XLA:CPU's max may skip a NaN: NaN rows apart
    hit = jnp.where(jnp.any(nan, -1, keepdims=True), nan, logits == top)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), -1)


def sample_logits(logits: Float[Array, "b v"], key: jax.Array, sc: SamplingConfig
                  ) -> Int[Array, " b"]:
    """Greedy, or temperature sampling restricted to the top-k and the top-p nucleus."""
    if sc.temperature == 0.0:
        return greedy(logits)
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


def _sink_first(cfg: ModelConfig, prompt, cache: KVCache, lens):
    """A learnable-sink model starts every stream with its sink token: rows whose cache is still
    empty get it in front of their prompt (other rows continue their stream unchanged)."""
    fresh = jnp.asarray(np.asarray(jax.device_get(cache.length)) == 0)  # [B]
    padded = jnp.concatenate([prompt, jnp.zeros((prompt.shape[0], 1), jnp.int32)], 1)
    return (jnp.where(fresh[:, None], with_sink(cfg, prompt), padded),
            lens + fresh.astype(jnp.int32))


def _prepare(cfg: ModelConfig, prompt, cache: KVCache, prompt_lengths, sc: SamplingConfig):
    """Checked ``(prompt, lens)``, the sink token in front where a stream starts, and room in a
    dense cache for the prompt and every token to be generated (shared by both generators)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    lens = check_chunk(cfg, prompt, cache, prompt_lengths)
    if (np.asarray(jax.device_get(lens)) < 1).any():
        raise ValueError("every row needs at least one prompt token (prompt_lengths >= 1): the "
                         "first generated token is sampled from the last prompt token's logits")
    if cfg.sink_id is not None:  # one more token to fit (and check) in the cache
        prompt, lens = _sink_first(cfg, prompt, cache, lens)
        lens = check_chunk(cfg, prompt, cache, lens)
    cache.kind.check_room(cache, np.asarray(jax.device_get(cache.length + lens)) +
                          sc.max_new_tokens)
    _check_output_fits(prompt.shape[0], sc.max_new_tokens)
    return prompt, lens


def _check_output_fits(batch: int, max_new_tokens: int) -> None:
    """The tokens come back in one [B, N] int32 array (N padded to a power of two; the loop
    carries it and a copy is returned): refused in one line when that cannot fit, instead of
    an out-of-memory error after the prompt is encoded."""
    need = 2 * 4 * batch * _width(max_new_tokens)
    free = available_bytes()
    if free is not None and need > free // 2:
        raise ValueError(f"max_new_tokens={max_new_tokens} needs {need / 2**30:.1f} GiB for the "
                         f"generated tokens of {batch} row(s), more than half the "
                         f"{free / 2**30:.1f} GiB free: generate in rounds of fewer tokens, "
                         f"carrying the cache from one to the next (the result's .cache)")


class DecodeState(NamedTuple):
    """What the decode loop carries from one step to the next (all [B] unless noted)."""

    step: Int[Array, ""]  # index of the next output column
    token: Int[Array, " b"]  # the last sampled token, to be written to the cache next
    pending: Bool[Array, " b"]  # the row has a sampled token not yet written to the cache
    done: Bool[Array, " b"]  # the row emitted EOS
    count: Int[Array, " b"]  # tokens generated so far
    out: Int[Array, "b n"]  # generated tokens (padded with eos_id)
    key: jax.Array
    cache: KVCache


def _still_writing(s: DecodeState) -> Bool[Array, ""]:
    """The loop's stop condition: every row has written its last sampled token (EOS, the token
    budget, or both), so the returned cache holds everything generated."""
    return jnp.any(s.pending)


def _decode_step(params, cfg: ModelConfig, rule: SamplingConfig, budget: Int[Array, ""],
                 eos: Int[Array, ""], s: DecodeState) -> DecodeState:
    """Write each pending token to the cache and sample the next one where the row may go on
    (not done, ``budget`` not reached). Every sampled token, EOS included, is written, so the
    returned cache continues the conversation exactly."""
    W = s.out.shape[1]
    params, step = loop_weights(params, s.step)  # else XLA widens W8/bf16 weights before the loop
    logits, cache = apply(params, cfg, s.token[:, None], s.cache, s.pending.astype(jnp.int32))
    key, sub = jax.random.split(s.key)
    new = sample_logits(logits[:, 0], sub, rule)
    can = s.pending & ~s.done & (step < budget)
    col = jnp.minimum(step, W - 1)
    old = jax.lax.dynamic_index_in_dim(s.out, col, 1, False)
    out = jax.lax.dynamic_update_index_in_dim(s.out, jnp.where(can, new, old), col, 1)
    return DecodeState(step=step + 1, token=jnp.where(can, new, s.token), pending=can,
                       done=s.done | (can & (new == eos)), count=s.count + can, out=out,
                       key=key, cache=cache)


def _width(n: int) -> int:
    """The output buffer's columns for a budget of ``n`` tokens: a power of two (at least 16),
    so every budget up to it runs the same compiled loop (the budget itself is a run-time
    value)."""
    return max(16, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "rule", "width"), donate_argnames=("cache",))
def _generate_jit(params, cfg: ModelConfig, rule: SamplingConfig, width: int, prompt, lens,
                  cache, key, budget: Int[Array, ""], eos: Int[Array, ""]):
    B = prompt.shape[0]
    logits, cache = apply(params, cfg, prompt, cache, lens, last_only=True)  # [B, 1, V]
    key, sub = jax.random.split(key)
    tok = sample_logits(logits[:, 0], sub, rule)
    out = jnp.full((B, width), jnp.maximum(eos, 0), jnp.int32).at[:, 0].set(tok)
    init = DecodeState(step=jnp.int32(1), token=tok, pending=jnp.ones((B,), bool),
                       done=tok == eos, count=jnp.ones((B,), jnp.int32), out=out, key=key,
                       cache=cache)
    s = jax.lax.while_loop(_still_writing,
                           functools.partial(_decode_step, params, cfg, rule, budget, eos), init)
    return s.out, s.count, s.cache


def generate(params, cfg: ModelConfig, prompt: Int[Array, "b p"], cache: KVCache,
             sampling: SamplingConfig = SamplingConfig(), key: Optional[jax.Array] = None,
             prompt_lengths: Optional[Int[Array, " b"]] = None) -> GenerateResult:
    """Feed ``prompt`` (right-padded to ``prompt_lengths``) and generate up to
    ``sampling.max_new_tokens`` tokens per row, all in one compiled loop. The token budget and
    the end token are run-time values: budgets up to the same power of two (and the same
    temperature, top-k and top-p) reuse one compiled program.

    A learnable-sink model (``cfg.sink == "learnable"``) gets its sink token in front of the
    prompt of every row whose cache is empty. The cache is donated: do not reuse the cache you
    passed in; use ``result.cache``, which holds the prompt and all generated tokens, so the
    next round of a chat is ``generate(params, cfg, next_prompt, result.cache, ...)``.
    """
    prompt, lens = _prepare(cfg, prompt, cache, prompt_lengths, sampling)
    prompt = _padded_to_bucket(prompt, cache)
    key = jax.random.key(0) if key is None else key
    out, count, cache = _generate_jit(*loop_args(params, cfg, sampling, prompt, lens, cache, key))
    return GenerateResult(out[:, :sampling.max_new_tokens], count, cache)


def prompt_bucket(T: int, cache: KVCache) -> int:
    """The padded length a T-token prompt is fed at, so that prompts of nearby lengths share a
    compiled program: as the cache's kind pads it (jaxllm.kinds; a ring to a power of two, then
    whole prefill blocks; score-based eviction not at all, since it attends the chunk whole)."""
    return cache.kind.bucket(T, cache.batch)


def _padded_to_bucket(prompt, cache: KVCache):
    T = prompt.shape[1]
    return jnp.pad(prompt, ((0, 0), (0, prompt_bucket(T, cache) - T)))


def loop_args(params, cfg: ModelConfig, sampling: SamplingConfig, prompt, lens, cache, key):
    """``_generate_jit``'s arguments for a call of :func:`generate` (prompt and lengths
    checked): what a test or a benchmark lowers the compiled loop with."""
    eos = -1 if sampling.eos_id is None else sampling.eos_id
    return (params, cfg, sampling.rule, _width(sampling.max_new_tokens), prompt, lens, cache, key,
            jnp.int32(sampling.max_new_tokens), jnp.int32(eos))


# ---- step-wise generation: the host drives (a chat, a server) ---------------------------------
# Two programs, each compiled once per shape whatever the prompt or answer lengths: feed writes a
# fixed-size chunk of prompt tokens and samples from the last valid one, step writes one token
# per row and samples the next. The host sees each token as it comes (to print it, to stop at a
# stop string) and decides when to stop; every sampled token is written before the turn ends, as
# in generate, so the cache continues the conversation exactly.

@functools.partial(jax.jit, static_argnames=("cfg", "rule"), donate_argnames=("cache",))
def feed(params, cfg: ModelConfig, rule: SamplingConfig, cache: KVCache,
         tokens: Int[Array, "b t"], lens: Int[Array, " b"], key: jax.Array
         ) -> tuple[Int[Array, " b"], KVCache]:
    """Write ``tokens`` (right-padded to ``lens``) into ``cache``; sample a token from each
    row's last valid one (meaningless where ``lens`` is 0)."""
    logits, cache = apply(params, cfg, tokens, cache, lens, last_only=True)  # [B, 1, V]
    return sample_logits(logits[:, 0], key, rule), cache


def feed_by_layer(params, cfg: ModelConfig, rule: SamplingConfig, cache: KVCache,
                  tokens: Int[Array, "b t"], lens: Int[Array, " b"], key: jax.Array
                  ) -> tuple[Int[Array, " b"], KVCache]:
    """:func:`feed`'s result through :func:`jaxllm.model.apply_by_layer`: one layer's program
    called for each layer instead of one program holding them all (less memory while a chat
    runs, a call more a layer). The cache is donated, as to :func:`feed`."""
    logits, cache = apply_by_layer(params, cfg, tokens, cache, lens, last_only=True)
    return _sample_first(logits, key, rule), cache


@functools.partial(jax.jit, static_argnames=("rule",))
def _sample_first(logits: Float[Array, "b 1 v"], key, rule: SamplingConfig):
    return sample_logits(logits[:, 0], key, rule)


@functools.partial(jax.jit, static_argnames=("cfg", "rule"), donate_argnames=("cache",))
def step(params, cfg: ModelConfig, rule: SamplingConfig, cache: KVCache,
         token: Int[Array, " b"], active: Int[Array, " b"], key: jax.Array
         ) -> tuple[Int[Array, " b"], KVCache]:
    """Write ``token`` into each row where ``active`` is 1 (rows at 0 are left as they are) and
    sample each row's next token."""
    return _one_token(params, cfg, rule, cache, token, active, key)


def _one_token(params, cfg: ModelConfig, rule: SamplingConfig, cache: KVCache, token, active,
               key) -> tuple[Int[Array, " b"], KVCache]:
    """:func:`step`'s work, also the body of :func:`steps`' loop."""
    logits, cache = apply(params, cfg, token[:, None], cache, active)
    return sample_logits(logits[:, 0], key, rule), cache


@functools.partial(jax.jit, static_argnames=("cfg", "rule", "width"),
                   donate_argnames=("cache",))
def steps(params, cfg: ModelConfig, rule: SamplingConfig, width: int, cache: KVCache,
          token: Int[Array, " b"], n: Int[Array, ""], eos: Int[Array, ""], key: jax.Array
          ) -> tuple[Int[Array, "b w"], Int[Array, " b"], KVCache, jax.Array]:
    """Up to ``n`` (<= ``width``) calls of :func:`step` in one program: write each row's
    ``token``, sample the next, and so on, a row stopping once it has sampled ``eos``. Returns
    the tokens sampled (``[B, width]``, a row's first ``count`` valid; the last of them is not
    written yet, as after :func:`step`), ``count``, the cache and the key to go on with.

    A host loop over :func:`step` pays each call's dispatch with the machine idle; this pays it
    once for ``n`` tokens (a chat's bursts; what it saves: docs/CPU.md, "A chat's answer")."""
    B = token.shape[0]

    def body(s):
        i, tok, out, count, done, key, cache = s
        p, i = loop_weights(params, i)  # else XLA widens W8/bf16 weights before the loop
        key, sub = jax.random.split(key)
        new, cache = _one_token(p, cfg, rule, cache, tok, (~done).astype(jnp.int32), sub)
        new = jnp.where(done, tok, new)
        out = jax.lax.dynamic_update_index_in_dim(out, new, i, 1)
        return i + 1, new, out, count + ~done, done | (new == eos), key, cache

    init = (jnp.int32(0), token, jnp.full((B, width), jnp.maximum(eos, 0), jnp.int32),
            jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), key, cache)
    _, _, out, count, _, key, cache = jax.lax.while_loop(
        lambda s: (s[0] < jnp.minimum(n, width)) & ~jnp.all(s[4]), body, init)
    return out, count, cache, key


def generate_python(params, cfg: ModelConfig, prompt, cache: KVCache,
                    sampling: SamplingConfig = SamplingConfig(), key=None, prompt_lengths=None
                    ) -> GenerateResult:
    """The same algorithm as :func:`generate` as a plain Python loop over :func:`forward`
    (one step at a time, easy to step through in a debugger; also the test oracle)."""
    prompt, lens = _prepare(cfg, prompt, cache, prompt_lengths, sampling)
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
