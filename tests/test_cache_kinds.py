"""A cache method added in this file alone: "keep every other token" (the tokens at even stream
positions stay, each at its own position; every token sees them and itself), as a policy and a
cache kind defined here, run through jaxllm's perplexity and generate against a token-by-token
list cache in numpy (tests/naive.py). And kernels chosen by argument: one process, two
choices, two programs."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Bool, Int

import jaxllm
import pallas_kernels.cpu
from jaxllm.attention import scores as sc
from jaxllm.config import Kernels
from jaxllm.kinds import CacheKind
from jaxllm.policy import CachePolicy, KVStorage
from jaxllm.ppl import stream_score
from jaxllm.rope import Rotation, model_rotation
from naive import NaiveStream, _attn_out
from conftest import LLAMA

PARAMS = jaxllm.init_params(LLAMA, jax.random.key(4))


class EveryOtherLayout(NamedTuple):
    pos: Int[Array, "b t"]  # each chunk token's stream position
    valid: Bool[Array, "b t"]
    filled: Int[Array, " b"]  # slots holding a token before the chunk
    write_slot: Int[Array, "b t"]  # the slot a kept token goes to; the cache's size: dropped
    new_length: Int[Array, " b"]

    @property
    def seen_length(self):
        return self.new_length


class EveryOtherPlan(NamedTuple):
    lay: EveryOtherLayout
    chunk: Rotation  # the chunk's tokens at their positions
    slots: Rotation  # slot i holds stream position 2i

    def attend(self, q, k, v, layer_cache, cfg, int8_att=None, keep_probs=False):
        ck, cv = layer_cache  # [B, KVH, C, Dh], pre-RoPE
        lay = self.lay
        (B, T), C = lay.pos.shape, ck.shape[2]
        c = jnp.arange(T)
        kept = lay.valid & (lay.pos % 2 == 0)
        cached = jnp.arange(C)[None, None, :] < lay.filled[:, None, None]  # [B, 1, C]
        own = (c[None, None, :] < c[None, :, None]) & kept[:, None, :] | (
            c[None, None, :] == c[None, :, None])  # [B, T, T]
        mask = jnp.concatenate([jnp.broadcast_to(cached, (B, T, C)), own], -1)
        parts = [sc.part_scores(q, self.chunk, ck, self.slots, cfg),
                 sc.part_scores(q, self.chunk, k, self.chunk, cfg)]
        out, _ = sc.attend(parts, [cv, v], mask, cfg)
        b = jnp.arange(B)[:, None]
        put = lambda arr, x: arr.at[b, :, lay.write_slot].set(  # noqa: E731
            x.transpose(0, 2, 1, 3).astype(arr.dtype), mode="drop")
        return out, (put(ck, k), put(cv, v)), None


@dataclasses.dataclass(frozen=True)
class EveryOther(CacheKind):
    size: int  # slots: holds the kept tokens of a stream of 2 * size tokens
    sinks = 0
    streams = False

    @property
    def slots(self) -> int:
        return self.size

    def layout(self, cache, lens, T):
        pos = cache.length[:, None] + jnp.arange(T)[None]
        valid = jnp.arange(T)[None] < lens[:, None]
        slot = jnp.where(valid & (pos % 2 == 0), pos // 2, self.size)
        return EveryOtherLayout(pos, valid, (cache.length + 1) // 2, slot, cache.length + lens)

    def plan(self, cfg, lay, B, T, freq):
        slots = jnp.broadcast_to(2 * jnp.arange(self.size), (B, self.size))
        return EveryOtherPlan(lay, model_rotation(cfg, lay.pos, freq),
                              model_rotation(cfg, slots, freq))

    def advance(self, cache, lay, logits, k, v, state):
        return logits, cache.replace(k=k, v=v, length=lay.new_length)

    def check_room(self, cache, need):
        if (np.asarray(need) > 2 * self.size).any():
            raise ValueError(f"keep-every-other holds {2 * self.size} tokens of a stream")


@dataclasses.dataclass(frozen=True)
class KeepEveryOther(CachePolicy):
    storage: KVStorage = KVStorage()
    name = "every-other"
    title = "every other"
    streams = False

    def slots(self, n_tokens: int) -> int:
        return n_tokens // 2 + 1

    @property
    def label(self) -> str:
        return self.title

    def make_cache(self, cfg, batch, n_tokens, dtype=None):
        return EveryOther(self.slots(n_tokens)).make(cfg, batch, self._dtype(dtype),
                                                     self.storage.quant)


class NaiveEveryOther(NaiveStream):
    """The list cache: every token appended, dropped after its step when its position is odd."""

    def _attention(self, li, q, k, v, trim):
        self.kv[li].append((self.t, k, v))
        pos = [t for t, _, _ in self.kv[li]]
        out = _attn_out(q, np.stack([a for _, a, _ in self.kv[li]]),
                        np.stack([b for _, _, b in self.kv[li]]), self.t, pos, cfg=self.cfg)
        if self.t % 2:
            self.kv[li].pop()
        return out


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_a_cache_method_defined_here_scores_as_its_list_cache():
    tokens = np.random.default_rng(0).integers(0, LLAMA.vocab_size, 30)
    nll, _ = stream_score(PARAMS, LLAMA, tokens, KeepEveryOther(), chunk=7)
    logits = NaiveEveryOther(PARAMS, LLAMA).run(tokens[:-1])
    ref = -np.take_along_axis(_log_softmax(logits), tokens[1:, None], -1)[:, 0]
    np.testing.assert_allclose(nll, ref, atol=2e-5, rtol=1e-5)
    # and it is not the dense cache's: the odd tokens were dropped
    dense, _ = stream_score(PARAMS, LLAMA, tokens, jaxllm.Dense(), chunk=7)
    assert np.abs(dense - ref).max() > 1e-2


def test_a_cache_method_defined_here_generates_as_its_list_cache():
    prompt = np.random.default_rng(1).integers(0, LLAMA.vocab_size, 9)
    n = 12
    res = jaxllm.generate(PARAMS, LLAMA, prompt[None], KeepEveryOther().make_cache(LLAMA, 1, 40),
                          jaxllm.SamplingConfig(max_new_tokens=n))
    naive = NaiveEveryOther(PARAMS, LLAMA)
    logits = naive.run(prompt)[-1]
    want = []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3  # no near-tie: float32 and float64 pick the same
        want.append(int(np.argmax(logits)))
        logits = naive.step(want[-1])
    assert np.asarray(res.tokens)[0].tolist() == want
    assert int(res.cache.length[0]) == len(prompt) + n


@pytest.mark.skipif(not (jax.default_backend() == "cpu"
                         and pallas_kernels.cpu.attention_available()),
                    reason=f"no decode-attention kernel here: {pallas_kernels.cpu.status()}")
def test_the_decode_kernel_is_chosen_by_argument_each_call_its_program():
    """The same decode step called with two kernel choices in one process, no cache cleared:
    each call's program runs the implementation it was asked for (its lowered text names the
    CPU kernel or does not), and both give the same logits."""
    cache = jaxllm.init_cache(LLAMA, 1, 2, 14)
    _, cache = jaxllm.forward(PARAMS, LLAMA, np.arange(20)[None] % 64, cache)
    tok = jnp.asarray([[5]], jnp.int32)
    out = {}
    for form in ("auto", "materialised", "auto"):
        cfg = dataclasses.replace(LLAMA, kernels=Kernels(attention=form))
        step = jax.jit(jaxllm.model.apply, static_argnames="cfg")
        text = step.lower(PARAMS, cfg, tok, cache, jnp.ones((1,), jnp.int32)).as_text()
        assert (pallas_kernels.cpu.ATTENTION_TARGET in text) == (form == "auto"), form
        out[form] = np.asarray(jaxllm.forward(PARAMS, cfg, tok, cache)[0])
    np.testing.assert_allclose(out["auto"], out["materialised"], atol=2e-5)
