"""The attention-sink cache against independent references: the naive list cache of the
authors' eval loop (tests/naive.py), the plain forward on the kept tokens, and the write-index
formula of the issue computed with Python integers."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA, NEOX, backend_compiles
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive import NaiveStream, _rope, naive_logits

import jaxllm
from jaxllm.config import Kernels
import pallas_kernels.cpu
from jaxllm.model import apply

PARAMS = {"neox": jaxllm.init_params(NEOX, jax.random.key(0)),
          "llama": jaxllm.init_params(LLAMA, jax.random.key(0))}
CFGS = {"neox": NEOX, "llama": LLAMA}


def slot_of(t: int, S: int, W: int) -> int:
    """The issue's modular write index, in Python integers (no overflow possible)."""
    return t if t < S else S + (t - S) % W


def stored_key(cfg, key, slot: int, S: int, W: int):
    """What a cache made by init_cache holds for pre-RoPE ``key`` [heads, hd] in ``slot``: the
    key rotated at the slot's position (j for a sink, ring offset - W; jaxllm.kv.cache's note), by
    the float64 formula."""
    return _rope(np.asarray(key, np.float64)[None], [slot if slot < S else slot - S - W], cfg,
                 0)[0]


YARN = dataclasses.replace(LLAMA, rope_scaling=jaxllm.config.RopeScaling(
    "yarn", 4.0, original_max_len=4))  # attention scale 1.14: applied once to queries and keys


@pytest.mark.parametrize("family", ["neox", "llama", "llama-yarn"])
def test_one_layer_equals_forward_on_kept_tokens(family):
    # With one layer, a cached key depends only on its token, so the cache must equal the plain
    # forward over [kept sinks + last W tokens] at positions 0..n-1 (docs/METHODS.md §1). Fed as
    # one chunk of 23 (blocks of W) and then a token at a time: both paths, over ring
    # wrap-arounds.
    cfg = dataclasses.replace(YARN if family == "llama-yarn" else CFGS[family], num_layers=1)
    params = jaxllm.init_params(cfg, jax.random.key(5))
    S, W, N = 3, 6, 40
    tokens = np.asarray(jax.random.randint(jax.random.key(6), (1, N), 0, cfg.vocab_size))
    ref = []
    for t in range(N):
        kept = list(range(min(S, t + 1))) + list(range(max(S, t - W + 1), t + 1))
        ref.append(jaxllm.forward(params, cfg, tokens[:, kept])[0][:, -1])
    got, cache = jaxllm.forward(params, cfg, tokens[:, :23],
                                jaxllm.init_cache(cfg, 1, sinks=S, window=W))
    got = [got]
    for t in range(23, N):
        logits, cache = jaxllm.forward(params, cfg, tokens[:, t:t + 1], cache)
        got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, 1), jnp.stack(ref, 1), atol=1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["neox", "llama"]), S=st.sampled_from([0, 1, 3]),
       W=st.sampled_from([1, 3, 6]), C=st.sampled_from([1, 4, 9]), B=st.sampled_from([1, 3]),
       data=st.data())
def test_chunked_padded_stream_equals_naive(family, S, W, C, B, data):
    """Random chunk fill per row (padding never written) vs the token-by-token naive cache,
    across many ring wrap-arounds (streams up to 8x the window)."""
    cfg, params = CFGS[family], PARAMS[family]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    n_calls = data.draw(st.integers(1, 7))
    cache = jaxllm.init_cache(cfg, B, sinks=S, window=W)
    streams = [[] for _ in range(B)]
    got = [[] for _ in range(B)]
    for _ in range(n_calls):
        lens = rng.integers(0, C + 1, size=B)
        toks = rng.integers(0, cfg.vocab_size, size=(B, C))
        logits, cache = jaxllm.forward(params, cfg, toks, cache, lens)
        for b in range(B):
            streams[b].extend(toks[b, :lens[b]])
            got[b].extend(np.asarray(logits[b, :lens[b]]))
    for b in range(B):
        n = len(streams[b])
        assert int(cache.length[b]) == min(n, S + W)
        if not n:
            continue
        naive = NaiveStream(params, cfg, S, W)
        ref = naive.run(streams[b])
        np.testing.assert_allclose(np.stack(got[b]), ref, atol=3e-5, rtol=1e-4)
        # Every kept token sits in the slot the write-index formula names, rotated at the
        # slot's position.
        assert cache.keys_rotated
        for pos, t in enumerate(naive.kept):
            slot = slot_of(t, S, W)
            np.testing.assert_allclose(cache.k[0][b, :, slot],
                                       stored_key(cfg, naive.kv[0][pos][0], slot, S, W),
                                       atol=1e-5)


def test_keys_stored_rotated_or_before_rope_give_the_same_logits():
    """The same GQA stream through a cache of rotated keys (init_cache's) and one of pre-RoPE
    keys (rotated where read, as quantized stores and dynamic NTK keep them): chunks across
    wrap-arounds, then decode steps. A rotated cache is refused by a config whose positions
    differ (dynamic NTK)."""
    cfg, params, S, W = LLAMA, PARAMS["llama"], 2, 5
    a = jaxllm.init_cache(cfg, 2, sinks=S, window=W)
    b = a.replace(kind=dataclasses.replace(a.kind, keys_rotated=False))
    assert a.keys_rotated
    rng = np.random.default_rng(11)
    for T in (9, 1, 1, 1, 1, 1, 1, 1):
        toks, lens = rng.integers(0, cfg.vocab_size, (2, T)), np.array([T, T // 2 + 1])
        la, a = jaxllm.forward(params, cfg, toks, a, lens)
        lb, b = jaxllm.forward(params, cfg, toks, b, lens)
        for r in range(2):
            np.testing.assert_allclose(la[r, :lens[r]], lb[r, :lens[r]], atol=2e-6)
    dyn = dataclasses.replace(cfg, rope_scaling=jaxllm.config.RopeScaling(
        "dynamic", 2.0, original_max_len=8))
    with pytest.raises(ValueError, match="stores its keys rotated"):
        jaxllm.forward(params, dyn, np.zeros((2, 1), np.int32), a)
    assert not jaxllm.init_cache(dyn, 1, S, W).keys_rotated


DECODE_CASES = {  # (cfg, sinks, window, ring)
    "neox 2+5": (NEOX, 2, 5, True),
    "llama window 4": (LLAMA, 0, 4, True),
    "llama dense 24": (LLAMA, 0, 24, False),
    "mistral-window 3, 2+6": (dataclasses.replace(LLAMA, sliding_window=3), 2, 6, True),
    "alibi 1+4": (dataclasses.replace(NEOX, pos_emb="alibi", rotary_pct=0.0), 1, 4, True),
    "zero sink 2+3": (dataclasses.replace(LLAMA, sink="zero"), 2, 3, True),
}


@pytest.fixture(params=["kernel", "jnp"])
def attention_path(request):
    """The Kernels a decode step's attention runs by: the CPU kernel
    (pallas_kernels/csrc/decode_attention.cc; skipped where it is not available) or XLA's form
    (what runs where it is not)."""
    if request.param == "kernel" and not (jax.default_backend() == "cpu"
                                          and pallas_kernels.cpu.attention_available()):
        pytest.skip(f"no decode-attention kernel here: {pallas_kernels.cpu.status()}")
    return Kernels(attention="auto" if request.param == "kernel" else "materialised")


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_steps_equal_naive(case, attention_path):
    """One token per call takes the decode path (write the token, then read the cache): two rows
    with different pauses (lengths 0) through sink filling, ring wrap-arounds and the window,
    against the token-by-token naive cache, by the CPU kernel and by the jnp path."""
    cfg, S, W, ring = DECODE_CASES[case]
    params = jaxllm.init_params(cfg, jax.random.key(3))
    cfg = dataclasses.replace(cfg, kernels=attention_path)
    rng = np.random.default_rng(4)
    cache = jaxllm.init_cache(cfg, 2, sinks=S, window=W, ring=ring)
    streams, got = [[], []], [[], []]
    for _ in range(22):
        toks = rng.integers(0, cfg.vocab_size, size=(2, 1))
        lens = np.array([1, rng.integers(0, 2)])
        logits, cache = jaxllm.forward(params, cfg, toks, cache, lens)
        for b in range(2):
            if lens[b]:
                streams[b].append(int(toks[b, 0]))
                got[b].append(np.asarray(logits[b, 0]))
    for b in range(2):
        ref = NaiveStream(params, cfg, S, W if ring else None).run(streams[b])
        np.testing.assert_allclose(np.stack(got[b]), ref, atol=3e-5, rtol=1e-4)


def test_decode_step_does_not_copy_the_cache():
    """The compiled decode step updates the donated cache in place: doubling the cache grows
    the step's scratch memory by less than half the cache's growth (reading the cache before
    writing it made XLA:CPU copy every layer's K and V each step: 1.3-2x the cache in scratch
    for this model, 2x for pythia-14m at 4096). Measured as growth, not against the cache's
    size, since a backend's scratch has a fixed part: on a GPU, cuBLAS's 32 MiB workspace."""
    import functools

    from jaxllm.model import apply
    cfg, params = NEOX, PARAMS["neox"]
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    for S in (0, 4):
        temp, size = [], []
        for C in (2048, 4096):
            cache = jaxllm.init_cache(cfg, 1, sinks=S, window=C - S)
            mem = step.lower(params, tokens=jnp.zeros((1, 1), jnp.int32), cache=cache,
                             lens=jnp.ones((1,), jnp.int32)).compile().memory_analysis()
            temp.append(mem.temp_size_in_bytes)
            size.append(2 * sum(k.nbytes for k in cache.k))
        assert temp[1] - temp[0] < (size[1] - size[0]) / 2, (S, temp, size)


def test_counters_near_2_31():
    """The cache stores no stream position, only bounded counters. Lay a ring out as it would be
    after 2**31 - 4 tokens and stream across 2**31: logits equal the same content laid out after
    S+W+3 tokens, and each token lands in slot S + (t - S) mod W for its huge t."""
    cfg, params, S, W = LLAMA, PARAMS["llama"], 2, 5
    toks = np.asarray(jax.random.randint(jax.random.key(7), (1, S + W + 3 + 10), 0, 64))
    _, a = jaxllm.forward(params, cfg, toks[:, :S + W + 3], jaxllm.init_cache(cfg, 1, S, W))
    n_a, n_b = S + W + 3, 2**31 - 4
    perm = [0] * W  # ring offset in b <- ring offset in a, for the token d back
    for d in range(1, W + 1):
        perm[(slot_of(n_b - d, S, W) - S)] = slot_of(n_a - d, S, W) - S
    idx = np.r_[np.arange(S), S + np.asarray(perm)]
    # Keys are stored rotated at their slot's position: a key moved from ring offset o to o'
    # turns by o' - o (in float64, then rounded as the cache stores it).
    turn = np.r_[np.zeros(S), np.arange(W) - np.asarray(perm)]

    def moved(k):  # [1, KVH, S+W, hd]
        k = np.asarray(k, np.float64)[0][:, idx].transpose(1, 0, 2)  # [S+W, KVH, hd]
        return jnp.asarray(_rope(k, turn, cfg, 0).transpose(1, 0, 2)[None], jnp.float32)

    assert a.keys_rotated
    b = a.replace(k=tuple(map(moved, a.k)), v=tuple(v[:, :, idx] for v in a.v),
                  head=jnp.asarray([(n_b - S) % W], jnp.int32))
    for i in range(10):
        la, a = jaxllm.forward(params, cfg, toks[:, n_a + i:n_a + i + 1], a)
        lb, b = jaxllm.forward(params, cfg, toks[:, n_a + i:n_a + i + 1], b)
        np.testing.assert_allclose(lb, la, atol=1e-6)
        # layer-0 keys depend on the token alone: the same key, in the formula's slot
        sa, sb = slot_of(n_a + i, S, W), slot_of(n_b + i, S, W)
        np.testing.assert_allclose(_rope(np.asarray(b.k[0][0, :, sb], np.float64)[None],
                                         [sa - sb], cfg, 0)[0], a.k[0][0, :, sa], atol=1e-6)
    assert b.length.dtype == jnp.int32 and int(b.length[0]) == S + W
    assert int(b.head[0]) == (n_b + 10 - S) % W


def test_counters_bounded_after_many_wraps():
    cfg, params, S, W = NEOX, PARAMS["neox"], 4, 3
    cache = jaxllm.init_cache(cfg, 1, S, W)
    n = 0
    for _ in range(5):
        _, cache = jaxllm.forward(params, cfg, np.ones((1, 50), np.int32), cache)
        n += 50
        assert int(cache.length[0]) == S + W and int(cache.head[0]) == (n - S) % W


def test_no_recompilation_while_streaming():
    cfg, params = NEOX, PARAMS["neox"]
    cache = jaxllm.init_cache(cfg, 1, sinks=4, window=60)
    chunk = np.zeros((1, 500), np.int32)
    for _ in range(2):  # warm-up
        _, cache = jaxllm.forward(params, cfg, chunk, cache)
    def stream():
        nonlocal cache
        for i in range(20):  # another 10K tokens
            logits, cache = jaxllm.forward(params, cfg, chunk + i % 7, cache)
        logits.block_until_ready()
    assert backend_compiles(stream) == []


def test_bad_input_errors():
    cfg, params = NEOX, PARAMS["neox"]
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        jaxllm.init_cache(cfg, 1, sinks=4, window=0)
    with pytest.raises(ValueError, match="sinks must be a non-negative"):
        jaxllm.init_cache(cfg, 1, sinks=-1, window=8)
    with pytest.raises(ValueError, match="batch 2 but the cache was made for batch 1"):
        jaxllm.forward(params, cfg, np.zeros((2, 3), np.int32), jaxllm.init_cache(cfg, 1, 0, 8))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 3\]"):
        jaxllm.forward(params, cfg, np.zeros((1, 3), np.int32), jaxllm.init_cache(cfg, 1, 0, 8),
                       np.array([4]))
    dense = jaxllm.init_cache(cfg, 1, sinks=0, window=8, ring=False)
    _, dense = jaxllm.forward(params, cfg, np.zeros((1, 6), np.int32), dense)
    with pytest.raises(ValueError, match="dense cache overflow"):
        jaxllm.forward(params, cfg, np.zeros((1, 3), np.int32), dense)
    # Under the user's own jit no exception can be raised: the overflowing row's logits are NaN.
    step = jax.jit(lambda c, t: jaxllm.forward(params, cfg, t, c))
    logits, _ = step(dense, jnp.zeros((1, 3), jnp.int32))
    assert np.isnan(np.asarray(logits)).all()
    logits, _ = step(dense, jnp.zeros((1, 2), jnp.int32))  # fits exactly: fine
    assert np.isfinite(np.asarray(logits)).all()


ROPE_CASES = {
    "neox": NEOX,
    "llama-gqa": LLAMA,
    "llama-linear-scaled": dataclasses.replace(
        LLAMA, rope_scaling=jaxllm.config.RopeScaling(kind="linear", factor=4.0)),
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_long_prompt_in_one_call_keeps_rotation_angles_bounded(name):
    """A 4,096-token prompt fed through a 4+60 cache in one call must be as accurate as feeding
    it one token at a time (within 2x of that path's float32 error against the float64 naive
    stream): no rotation angle may use a position beyond the cache plus a bounded block, however
    long the chunk (float32 angles at position ~4000 are coarse)."""
    cfg = ROPE_CASES[name]
    # q and k 25x their init scale: attention logits as sharp as a trained model's (with init-
    # scale weights the scores are too small for angle errors to show).
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 25 if path[-2].key in ("q", "k") and x.ndim == 2 else x,
        jaxllm.init_params(cfg, jax.random.key(7)))
    S, W, T = 4, 60, 4096
    tokens = np.asarray(jax.random.randint(jax.random.key(8), (1, T), 0, cfg.vocab_size))
    ref = naive_logits(params, cfg, tokens, sinks=S, window=W)[0]
    one_call, _ = jaxllm.forward(params, cfg, tokens, jaxllm.init_cache(cfg, 1, S, W))

    @jax.jit
    def token_by_token(params, cache, toks):  # T one-token forwards, scanned in one jit
        def step(c, t):
            lg, c = apply(params, cfg, t[None, None], c, jnp.ones((1,), jnp.int32))
            return c, lg[0, 0]
        return jax.lax.scan(step, cache, toks)[1]

    steps = token_by_token(params, jaxllm.init_cache(cfg, 1, S, W), jnp.asarray(tokens[0]))
    err_step = np.abs(np.asarray(steps) - ref).max()
    err_call = np.abs(np.asarray(one_call[0]) - ref).max()
    assert err_call <= 2 * err_step, (err_call, err_step)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_cache_holds_the_float32_cache_rounded(dtype):
    """A one-layer model's keys and values do not depend on the cache, so after a chunk and
    decode steps past a full ring (batch 2), a 2-byte cache holds exactly the float32 cache's
    entries rounded to its dtype (a bfloat16 cache on CPU as its bits, stores.Bf16Bits)."""
    from jaxllm.kv import stores
    cfg = dataclasses.replace(LLAMA, num_layers=1)
    params = jaxllm.init_params(cfg, jax.random.key(2))
    toks = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 14))
    caches = {}
    for dt in (jnp.float32, dtype):
        c = jaxllm.init_cache(cfg, 2, sinks=2, window=5, dtype=dt)
        _, c = jaxllm.forward(params, cfg, toks[:, :6], c)
        for t in range(6, 14):
            _, c = jaxllm.forward(params, cfg, toks[:, t:t + 1], c)
        caches[dt] = c
    for a, b in ((caches[jnp.float32].k[0], caches[dtype].k[0]),
                 (caches[jnp.float32].v[0], caches[dtype].v[0])):
        assert b.dtype == dtype
        np.testing.assert_array_equal(np.asarray(a.astype(dtype), np.float32),
                                      np.asarray(stores.read(b, None), np.float32))


@pytest.mark.parametrize("family", ["neox", "llama"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_over_a_narrow_cache_is_the_float32_product(family, dtype, attention_path):
    """A decode step reads a bfloat16 cache on CPU as its uint16 bits (kv.stores.Bf16Bits) and a
    float16 cache as stored, widened in registers by the CPU kernel or a few heads at a time by
    the jnp path (bits.in_widened_groups): on the same 2-byte keys and values, widened to
    float32 for the float32 path, both give the same output to float32 rounding, on a ring past
    a lap; also with groups of one head (a loop over all)."""
    from jaxllm.kv import cache as kvc
    from jaxllm import bits
    from jaxllm.attention.decode import attend_cache
    from jaxllm.rope import inv_freq
    cfg = dataclasses.replace(CFGS[family], kernels=attention_path)
    B, S, W = 2, 2, 13
    cache = jaxllm.init_cache(cfg, B, sinks=S, window=W)
    cache = cache.replace(length=jnp.asarray([S + W, 9], jnp.int32),
                          head=jnp.asarray([4, 7], jnp.int32))
    lay = kvc.chunk_layout(cache, jnp.ones((B,), jnp.int32), 1)
    freq = inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, lay.new_length)
    plan = cache.kind.plan(cfg, lay, B, 1, freq)
    rng = np.random.default_rng(0)
    shape = (B * cfg.num_kv_heads, S + W, cfg.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape) * 3, dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)
    wide = attend_cache(q, k.astype(jnp.float32), v.astype(jnp.float32), plan, cfg)
    if dtype == "bfloat16":
        k, v = bits.to_bits(k), bits.to_bits(v)
    for budget in (bits.WIDEN_BYTES, 1):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bits, "WIDEN_BYTES", budget)
            narrow = attend_cache(q, k, v, plan, cfg)
        np.testing.assert_allclose(np.asarray(narrow), np.asarray(wide), rtol=0, atol=2e-6)
