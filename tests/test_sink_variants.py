"""Sink-token variants (docs/METHODS.md §2) in the model: zero sink against an explicit prepended
all-zero key/value token, learnable sink as one extra embedding row that streams first."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA, NEOX
from naive import naive_logits

import jaxllm
from jaxllm import tree
from jaxllm.policy import StreamingLLM
from jaxllm.ppl import stream_score


@pytest.mark.parametrize("base", [NEOX, LLAMA], ids=["neox", "llama"])
def test_zero_sink_equals_prepended_zero_key_value(base):
    cfg = dataclasses.replace(base, sink="zero")
    params = jaxllm.init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, cfg.vocab_size)
    logits, _ = jaxllm.forward(params, cfg, tokens)
    np.testing.assert_allclose(logits, naive_logits(params, cfg, tokens), atol=2e-5, rtol=1e-4)
    vanilla, _ = jaxllm.forward(params, dataclasses.replace(cfg, sink="none"), tokens)
    assert np.abs(np.asarray(logits - vanilla)).max() > 1e-3  # the zero sink does something
    # The streaming cache with sinks + window follows the same rule token by token.
    cache = jaxllm.init_cache(cfg, 2, sinks=2, window=3)
    got, _ = jaxllm.forward(params, cfg, tokens, cache)
    np.testing.assert_allclose(got, naive_logits(params, cfg, tokens, sinks=2, window=3),
                               atol=2e-5, rtol=1e-4)


def test_learnable_sink_adds_exactly_one_embedding_row():
    plain = tree.flatten(jax.eval_shape(lambda: jaxllm.init_params(NEOX, jax.random.key(0))))
    cfg = dataclasses.replace(NEOX, sink="learnable")
    sink = tree.flatten(jax.eval_shape(lambda: jaxllm.init_params(cfg, jax.random.key(0))))
    assert sink.keys() == plain.keys()
    diff = {k: (plain[k].shape, sink[k].shape) for k in plain if plain[k].shape != sink[k].shape}
    assert diff == {"embed/embedding": ((64, 32), (65, 32))}
    assert cfg.sink_id == 64
    params = jaxllm.init_params(cfg, jax.random.key(0))
    logits, _ = jaxllm.forward(params, cfg, jnp.array([[cfg.sink_id, 3, 4]]))
    assert logits.shape == (1, 3, 64)  # the sink is input-only: no logit for it


def test_learnable_sink_leads_every_stream():
    cfg = dataclasses.replace(NEOX, sink="learnable")
    params = jaxllm.init_params(cfg, jax.random.key(3))
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (30,), 0, 64))
    # Reference: the model run on [sink] + tokens with a naive 1+5 streaming cache; the scores
    # of tokens[1:] are what stream_score reports.
    ref = naive_logits(params, cfg, np.concatenate([[cfg.sink_id], tokens])[None], sinks=1,
                       window=5)[0]
    logp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(
        -1, keepdims=True)
    want = -logp[np.arange(1, 30), tokens[1:]]
    got, _ = stream_score(params, cfg, tokens, StreamingLLM(sinks=1, cache=6), chunk=7)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # generate() on a fresh cache puts the sink first: the same as prompting with it by hand.
    sc = jaxllm.SamplingConfig(max_new_tokens=6)
    auto = jaxllm.generate(params, cfg, tokens[None, :8], jaxllm.init_cache(cfg, 1, 1, 5), sc)
    # By hand: the sink fed first, then the prompt into the (no longer fresh) cache.
    _, cache = jaxllm.forward(params, cfg, jnp.array([[cfg.sink_id]]), jaxllm.init_cache(cfg, 1, 1, 5))
    by_hand = jaxllm.generate(params, cfg, tokens[None, :8], cache, sc)
    np.testing.assert_array_equal(auto.tokens, by_hand.tokens)
