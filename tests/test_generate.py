"""generate() against its Python twin and a hand-written greedy loop over forward()."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxllm
from jaxllm.kv.cache import Bf16Bits
from jaxllm.generate import greedy, sample_logits
from jaxllm.kv.evict import Evict

PARAMS = jaxllm.init_params(LLAMA, jax.random.key(0))


def greedy_by_hand(prompt, n, sinks, window):
    """Oracle: argmax step by step with forward(), one row at a time."""
    cache = jaxllm.init_cache(LLAMA, 1, sinks=sinks, window=window)
    logits, cache = jaxllm.forward(PARAMS, LLAMA, np.asarray([prompt]), cache)
    out = []
    for _ in range(n):
        out.append(int(jnp.argmax(logits[0, -1])))
        logits, cache = jaxllm.forward(PARAMS, LLAMA, np.asarray([[out[-1]]]), cache)
    return out


def test_steps_are_calls_of_step_stopping_at_eos():
    """generate.steps (a chat's burst) against a hand-written greedy loop for the tokens and
    against calls of step() for the cache: two rows through a ring that wraps, one stopping at
    its end token inside the burst, the burst cut at n < width."""
    from jaxllm.generate import feed, step, steps
    prompts = np.asarray([[5, 9, 11, 2, 7], [3, 4, 8, 8, 1]], np.int32)
    want = [greedy_by_hand(list(p), 9, 2, 6) for p in prompts]
    eos = want[0][3]  # row 0 samples it as its third token of the burst
    cut = [next((i + 1 for i, t in enumerate(w[1:7]) if t == eos), 6) for w in want]
    rule = jaxllm.SamplingConfig().rule
    key = jax.random.key(0)

    def fed():
        cache = jaxllm.init_cache(LLAMA, 2, sinks=2, window=6)
        return feed(PARAMS, LLAMA, rule, cache, prompts, np.asarray([5, 5], np.int32), key)

    tok, cache = fed()
    assert list(np.asarray(tok)) == [w[0] for w in want]
    out, count, cache, _ = steps(PARAMS, LLAMA, rule, 8, cache, tok, np.int32(6),
                                 np.int32(eos), key)
    assert list(np.asarray(count)) == cut and cut[0] == 3
    for b in range(2):
        assert list(np.asarray(out[b, :cut[b]])) == want[b][1:1 + cut[b]]
    tok, ref = fed()  # the same through step, a row left alone once it has sampled eos
    done = np.zeros(2, bool)
    for _ in range(6):
        tok, ref = step(PARAMS, LLAMA, rule, ref, tok, (~done).astype(np.int32), key)
        done |= np.asarray(tok) == eos
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=2, window=6),  # StreamingLLM, keys rotated
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=0, window=40, ring=False),  # dense
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=2, window=6, dtype=jnp.bfloat16),
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=2, window=16,
                              kv_quant=jaxllm.KVQuant("token", bits=4, group=8)),
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=2, window=16,
                              kv_quant=jaxllm.KVQuant("kivi", bits=4, group=8, residual=8)),
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=1, evict_by=Evict("h2o", 3, 2)),
    lambda: jaxllm.init_cache(LLAMA, 3, sinks=1, window=3),  # a chunk wider than a block
], ids=["ring", "dense", "bf16", "kbit", "kivi", "h2o", "ring-in-blocks"])
def test_feed_by_layer_is_feed(make):
    """A chunk through one program per layer (the chat's prompt) against feed's one program:
    the same sampled tokens and the same cache, chunk after chunk (the ring wraps), with a row
    whose chunk is padding only (lens 0: left alone) and one fed fewer tokens than the width."""
    from jaxllm.generate import feed, feed_by_layer
    rule = jaxllm.SamplingConfig(temperature=0.8).rule
    rng = np.random.default_rng(0)
    a, b = make(), make()
    for step, lens in enumerate(([4, 0, 3], [4, 4, 1], [2, 4, 4])):
        tokens = rng.integers(1, LLAMA.vocab_size, (3, 4)).astype(np.int32)
        key = jax.random.key(step)
        lens = np.asarray(lens, np.int32)
        ta, a = feed(PARAMS, LLAMA, rule, a, tokens, lens, key)
        tb, b = feed_by_layer(PARAMS, LLAMA, rule, b, tokens, lens, key)
        assert list(np.asarray(ta)) == list(np.asarray(tb))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                       rtol=1e-5, atol=1e-5)


def test_greedy_matches_hand_loop_with_padding_and_wraparound():
    prompts = [[5, 9, 11, 2, 7, 7, 1], [3, 4]]
    lens = np.array([7, 2])
    padded = np.zeros((2, 7), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    sc = jaxllm.SamplingConfig(max_new_tokens=20)
    cache = jaxllm.init_cache(LLAMA, 2, sinks=2, window=6)  # 27 tokens through 8 slots
    res = jaxllm.generate(PARAMS, LLAMA, padded, cache, sc, prompt_lengths=lens)
    for b, p in enumerate(prompts):
        assert list(np.asarray(res.tokens[b])) == greedy_by_hand(p, 20, 2, 6)
    assert list(res.num_tokens) == [20, 20]
    assert cache.k[0].is_deleted()  # donated: the loop updated the cache in place


def test_one_compiled_loop_serves_every_budget_and_end_token():
    """Budgets 3 to 16 and different end tokens run one compiled loop (JAX traces
    ``_generate_jit`` once, counted by its compile events, not by time); each result is the
    hand-written greedy loop's, cut at its budget or its end token."""
    traced = []

    def on(event, secs, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration" and \
                "_generate_jit" in str(kw.get("fun_name")):
            traced.append(kw["fun_name"])
    want = greedy_by_hand([5, 9, 11], 16, 2, 6)
    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        for n, eos in ((3, None), (16, None), (9, want[4]), (5, -7 % LLAMA.vocab_size)):
            res = jaxllm.generate(PARAMS, LLAMA, np.asarray([[5, 9, 11]]),
                                  jaxllm.init_cache(LLAMA, 1, sinks=2, window=6),
                                  jaxllm.SamplingConfig(max_new_tokens=n, eos_id=eos))
            k = want.index(eos) + 1 if eos in want[:n] else n
            assert res.tokens.shape == (1, n) and int(res.num_tokens[0]) == k
            assert list(np.asarray(res.tokens[0, :k])) == want[:k]
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
    assert len(traced) == 1, traced


def test_nearby_prompt_lengths_share_one_compiled_loop():
    """Prompts are fed padded to a bucket (here whole prefill blocks of a 7-slot window, a shape no other test here compiles):
    lengths 3 and 5 run one program, 9 and 12 another; every answer is the greedy loop's."""
    traced = []

    def on(event, secs, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration" and \
                "_generate_jit" in str(kw.get("fun_name")):
            traced.append(kw["fun_name"])
    rng = np.random.default_rng(3)
    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        for T in (3, 5, 9, 12):
            prompt = [int(t) for t in rng.integers(0, LLAMA.vocab_size, T)]
            res = jaxllm.generate(PARAMS, LLAMA, np.asarray([prompt]),
                                  jaxllm.init_cache(LLAMA, 1, sinks=2, window=7),
                                  jaxllm.SamplingConfig(max_new_tokens=8))
            assert list(np.asarray(res.tokens[0])) == greedy_by_hand(prompt, 8, 2, 7), T
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
    assert len(traced) == 2, traced
    from jaxllm.generate import prompt_bucket
    ring = jaxllm.init_cache(LLAMA, 1, sinks=4, window=1020)
    assert [prompt_bucket(T, ring) for T in (1, 17, 200, 257, 700, 1000, 1500)] == \
        [16, 32, 256, 512, 768, 1020, 2040]
    dense = jaxllm.init_cache(LLAMA, 1, sinks=0, window=40, ring=False)
    assert [prompt_bucket(T, dense) for T in (3, 20, 40)] == [16, 32, 40]


def test_bfloat16_cache_generates_in_place():
    """A bfloat16 cache (on CPU its uint16 bits, kv.stores.Bf16Bits) through the one-jit loop: the
    greedy tokens of the per-token Python loop, the same cache contents, and its bits donated."""
    prompt, sc = np.asarray([[5, 9, 11, 2], [3, 4, 6, 1]]), jaxllm.SamplingConfig(max_new_tokens=14)
    caches = [jaxllm.init_cache(LLAMA, 2, sinks=2, window=6, dtype=jnp.bfloat16) for _ in "ab"]
    a = jaxllm.generate(PARAMS, LLAMA, prompt, caches[0], sc)
    b = jaxllm.generate_python(PARAMS, LLAMA, prompt, caches[1], sc)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    read = lambda layer: layer.read() if isinstance(layer, Bf16Bits) else layer  # noqa: E731
    for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(read(x), np.float32),
                                      np.asarray(read(y), np.float32))
    if jax.default_backend() == "cpu":
        assert caches[0].k[0].bits.is_deleted()


@pytest.mark.parametrize("sc", [
    jaxllm.SamplingConfig(max_new_tokens=12, temperature=0.8),
    jaxllm.SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=5),
    jaxllm.SamplingConfig(max_new_tokens=12, temperature=1.2, top_p=0.7),
], ids=["temperature", "top_k", "top_p"])
def test_jit_loop_equals_python_twin(sc):
    prompt = np.asarray([[1, 2, 3, 4], [9, 8, 7, 0]])
    key = jax.random.key(42)
    a = jaxllm.generate(PARAMS, LLAMA, prompt, jaxllm.init_cache(LLAMA, 2, 1, 5), sc, key,
                        prompt_lengths=np.array([4, 3]))
    b = jaxllm.generate_python(PARAMS, LLAMA, prompt, jaxllm.init_cache(LLAMA, 2, 1, 5), sc, key,
                               prompt_lengths=np.array([4, 3]))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.cache.k[1], b.cache.k[1], atol=1e-5)


def test_eos_stops_each_row_independently():
    prompt = np.asarray([[5, 9, 11], [3, 4, 6]])
    free = greedy_by_hand([5, 9, 11], 10, 0, 64)
    eos = free[3]  # row 0 hits EOS at step 3; row 1 may or may not
    sc = jaxllm.SamplingConfig(max_new_tokens=10, eos_id=eos)
    res = jaxllm.generate(PARAMS, LLAMA, prompt, jaxllm.init_cache(LLAMA, 2, 0, 64), sc)
    stop0 = free.index(eos) + 1
    assert int(res.num_tokens[0]) == stop0
    assert list(np.asarray(res.tokens[0, :stop0])) == free[:stop0]
    assert (np.asarray(res.tokens[0, stop0:]) == eos).all()
    free1 = greedy_by_hand([3, 4, 6], 10, 0, 64)
    stop1 = free1.index(eos) + 1 if eos in free1 else 10
    assert list(np.asarray(res.tokens[1, :int(res.num_tokens[1])])) == free1[:stop1]
    # The cache holds prompt + generated tokens (EOS included) for each row, nothing more.
    assert list(np.asarray(res.cache.length)) == [3 + stop0, 3 + stop1]


def test_multi_round_chat_equals_one_stream():
    sc = jaxllm.SamplingConfig(max_new_tokens=6)
    cache = jaxllm.init_cache(LLAMA, 1, sinks=2, window=10)
    r1 = jaxllm.generate(PARAMS, LLAMA, np.asarray([[1, 2, 3]]), cache, sc)
    r2 = jaxllm.generate(PARAMS, LLAMA, np.asarray([[4, 5]]), r1.cache, sc)
    # One stream: [1,2,3] + reply1 + [4,5], then greedy.
    history = [1, 2, 3] + list(np.asarray(r1.tokens[0])) + [4, 5]
    assert list(np.asarray(r2.tokens[0])) == greedy_by_hand(history, 6, 2, 10)


# Few distinct values, so ties are common; NaN and infinities included.
LOGIT = st.sampled_from([-np.inf, -2.0, -0.0, 0.0, 1.5, 3.0, np.inf, np.nan])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3).flatmap(lambda b: st.integers(1, 9).flatmap(
    lambda v: st.lists(st.lists(LOGIT, min_size=v, max_size=v), min_size=b, max_size=b))))
def test_greedy_is_numpys_argmax(rows):
    """numpy's argmax is the definition: the first maximum, or the first NaN."""
    x = np.asarray(rows, np.float32)
    got = np.asarray(jax.jit(greedy)(x))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_greedy_is_numpys_argmax_over_a_vocabulary():
    """A vocabulary's width, where XLA:CPU's vectorised max may skip a NaN: still the first NaN,
    and the first of tied maxima."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 50304)).astype(np.float32)
    x[0, [7, 30000]] = np.nan
    x[1, [123, 40000, 50303]] = np.nan
    x[2, [5, 44444]] = 9.0  # a tie
    x[3, 50303] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy)(x)), np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(jnp.argmax, static_argnums=1)(x, -1)),
                                  np.argmax(x, axis=-1))  # what greedy replaced agrees too


def test_top_k_and_top_p_sample_only_from_the_allowed_set():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.3, 0.15, 0.1]]))
    keys = jax.random.split(jax.random.key(0), 400)
    draw = lambda sc: {int(sample_logits(logits, k, sc)[0]) for k in keys}  # noqa: E731
    assert draw(jaxllm.SamplingConfig(temperature=1.0, top_k=2)) == {1, 2}
    # nucleus 0.8: 0.4 + 0.3 = 0.7 < 0.8, so 0.15 joins; 0.85 >= 0.8 stops it
    assert draw(jaxllm.SamplingConfig(temperature=1.0, top_p=0.8)) == {1, 2, 3}
    assert draw(jaxllm.SamplingConfig(temperature=1.0)) == {0, 1, 2, 3, 4}


def test_generate_errors():
    with pytest.raises(ValueError, match="top_p"):
        jaxllm.SamplingConfig(top_p=0.0)
    dense = jaxllm.init_cache(LLAMA, 1, sinks=0, window=8, ring=False)
    with pytest.raises(ValueError, match="dense cache overflow"):
        jaxllm.generate(PARAMS, LLAMA, np.ones((1, 4), np.int32), dense,
                        jaxllm.SamplingConfig(max_new_tokens=5))
    with pytest.raises(ValueError, match="at least one prompt token"):
        jaxllm.generate(PARAMS, LLAMA, np.ones((1, 4), np.int32), dense,
                        jaxllm.SamplingConfig(max_new_tokens=2), prompt_lengths=np.array([0]))


def test_a_prompt_chunk_writes_the_cache_in_place(monkeypatch):
    """generate writes a prompt chunk's keys and values into the donated cache, no copy of it.
    Where the ring is one key block (the attention's loops run once and XLA removes them),
    nothing ordered the write after the reads of the ring, and XLA copied every layer's keys
    and values before the write and back into the donated cache after the decode loop: 4
    copies a layer (SmolLM2: 120 of 0.75 MiB a call). Counted in the compiled program's text:
    copies of an array of a cache layer's shape; the attention's default blocks (the tests'
    small ones, conftest.py, make several)."""
    import re

    from jaxllm.attention import flash
    from jaxllm.generate import _generate_jit, loop_args
    monkeypatch.setattr(flash, "SCORE_BLOCK_ELEMENTS", 1 << 24)
    cfg = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                   num_kv_heads=2, intermediate_size=128, max_seq_len=256)
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))
    # (a window no other test traces: the loop is traced here, with the default blocks)
    cache = jaxllm.init_cache(cfg, 1, sinks=2, window=19)
    B, KVH, C, Dh = cache.k[0].shape
    text = _generate_jit.lower(*loop_args(params, cfg, jaxllm.SamplingConfig(max_new_tokens=4),
                                          jnp.ones((1, 4), jnp.int32), jnp.array([4], jnp.int32),
                                          cache, jax.random.key(0))).compile().as_text()
    layer = re.escape(f"f32[{B},{KVH},{C},{Dh}]")
    assert not re.findall(layer + r"\{[\d,]*\} copy\(", text)


@pytest.mark.parametrize("weights", ["w8", "bfloat16"])
def test_decode_loops_read_narrow_weights_in_place(weights):
    """The compiled decode loops (generate's while loop, stepwise perplexity's scan) read int8
    and bfloat16 weights as stored. XLA's loop-invariant code motion would otherwise widen them
    to float32 once, before the loop: a float32 copy of every weight in temporary memory (and
    4x W8's bytes read per step). Reference: the float32 model's own programs, which hold no
    weight copy; a hoisted copy of even a quarter of the weights fails the bound."""
    from jaxllm.generate import _generate_jit, loop_args
    from jaxllm.ppl import nll_chunk
    cfg = jaxllm.ModelConfig.gpt_neox(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                      rotary_pct=0.5)
    params = jaxllm.init_params(cfg, jax.random.key(0))
    if weights == "w8":
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 256)
        narrow = jaxllm.smoothquant.quantize(params, cfg, ids, "w8", smooth=False,
                                             calib=jaxllm.CalibConfig(n_seqs=2, seq_len=16,
                                                                      batch=2))
    else:
        narrow = jaxllm.quant.half_weights(params)
    policy = jaxllm.StreamingLLM(2, 16)
    toks, lens = jnp.ones((1, 4), jnp.int32), jnp.array([4], jnp.int32)

    def temp_bytes(p):  # [generate, stepwise nll]
        gen = _generate_jit.lower(*loop_args(p, cfg, jaxllm.SamplingConfig(max_new_tokens=4),
                                             toks, lens, policy.make_cache(cfg, 1, 0),
                                             jax.random.key(0)))
        # score-based eviction scores one token at a time: the scan
        nll = nll_chunk.lower(p, cfg, jaxllm.H2O(cache=16).make_cache(cfg, 1, 4), toks, toks,
                              lens)
        return [f.compile().memory_analysis().temp_size_in_bytes for f in (gen, nll)]

    copy = sum(x.nbytes for x in jax.tree.leaves(params))  # a float32 copy of the weights
    for name, narrow_b, float_b in zip(("generate", "stepwise nll"), temp_bytes(narrow),
                                       temp_bytes(params)):
        assert narrow_b < float_b + copy / 4, (name, narrow_b, float_b, copy)


@pytest.mark.parametrize("weights", ["4bit", "w8", "bfloat16"])
def test_prefill_widens_one_layer_weights_at_a_time(weights):
    """A prefill's rows multiply a float copy of each narrow weight (GEMM speed), made as its
    layer runs. XLA's scheduler is free to make every copy at the start, since they depend on
    the weights alone, and it did: a 512-token SmolLM2 prefill held 400 MiB of float32 weight
    copies (docs/CPU.md, "Peak memory"). Reference: the float32 model's program, which has no
    copy to make; four layers' hoisted copies would exceed it by 4x one layer's, the bound
    allows one."""
    from jaxllm.generate import feed
    from jaxllm import lowbit, tree
    from jaxllm.quant import QKernel
    cfg = jaxllm.ModelConfig.llama(vocab_size=264, hidden_size=512, num_layers=4, num_heads=8,
                                   num_kv_heads=8, intermediate_size=1536, max_seq_len=256)
    S = jax.ShapeDtypeStruct
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))

    def narrow(kernel):  # an [in, out] float kernel as the format stores it, abstractly
        n, o = kernel.shape
        if weights == "4bit":  # a GGUF Q4_1's layout: 8 codes a word, groups of 32
            return lowbit.QLowBit(S((o, n // 8), jnp.uint32), S((o, n // 32), jnp.float16),
                                  S((o, n // 32), jnp.float16), bits=4, group=32,
                                  in_features=n)
        if weights == "w8":
            return QKernel(S((o, n), jnp.int8), S((o,), jnp.float32), act="none")
        return QKernel(S((o, n), jnp.bfloat16), S((), jnp.float32), act="none")
    flat = tree.flatten(params)
    layer_bytes = sum(4 * v.size for k, v in flat.items() if k.startswith("layer_0/")
                      and k.endswith("/kernel"))
    flat = {k: narrow(v) if k.startswith("layer_") and k.endswith("/kernel") else v
            for k, v in flat.items()}
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, 1, sinks=4, window=124))
    rule = jaxllm.SamplingConfig().rule

    def temp(p):
        return feed.lower(p, cfg, rule, cache, S((1, 64), jnp.int32), S((1,), jnp.int32),
                          jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes
    assert temp(tree.unflatten(flat)) < temp(params) + 1.5 * layer_bytes, layer_bytes
