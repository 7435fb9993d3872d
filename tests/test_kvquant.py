"""The quantized KV cache against independent numpy references written from docs/METHODS.md
§5 (Q-Hitter's quantizer, KIVI's quantizer and packing), not from jaxllm.kv.quantized: the
quantizers' golden cases, the packing, and whole-model logits of a streamed, chunked run against
the naive list cache storing every non-sink token quantized by the numpy quantizer."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_compiles
from naive import NaiveStream

import jaxllm
from jaxllm.kv import quantized as kq
from jaxllm.kv.cache import kv_bytes
from jaxllm.kv.kivi import kivi_counts

# head_dim 16: 2-bit codes fill exactly one uint32 word per head
CFG = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, intermediate_size=96)
PARAMS = jaxllm.init_params(CFG, jax.random.key(3))


# ---- numpy references ------------------------------------------------------------------------
def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def np_token(x, bits, G):
    """KIVI's quantizer per group of G channels with a float minimum (METHODS §3), scale and
    minimum kept in float16; a constant group (scale 0) is stored as its minimum."""
    x = np.asarray(x, np.float32)
    xg = x.reshape(*x.shape[:-1], -1, G)
    mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    levels = 2 ** bits - 1
    scale, mn = f16((mx - mn) / levels), f16(mn)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.round(np.clip((xg - mn) / scale, 0, levels)), 0)
    return (q * scale + mn).reshape(x.shape), q.reshape(x.shape)


def np_qhitter(x, bits):
    """Q-Hitter's Quantization_simulated (METHODS §2): integer zero-point clamped to [0, 2^b-1],
    the whole row one group."""
    x = np.asarray(x, np.float64)
    levels = 2 ** bits - 1
    mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = np.maximum(mx - mn, 1e-5) / levels
    zero = np.clip(-np.round(mn / scale), 0, levels)
    return (np.clip(np.round(x / scale) + zero, 0, levels) - zero) * scale


def np_int8(x):
    x = np.asarray(x, np.float32)
    m = np.abs(x).max(-1, keepdims=True)
    s = f16(np.where(m > 0, m / 127, 1.0))
    return np.clip(np.round(x / s), -127, 127) * s


def np_pack(codes, bits):
    """32/b codes per uint32, LSB first: element j in bits [b·j, b·j+b) (METHODS §3)."""
    per = 32 // bits
    c = np.asarray(codes, np.uint64).reshape(*codes.shape[:-1], -1, per)
    words = np.zeros(c.shape[:-1], np.uint64)
    for j in range(per):
        words |= c[..., j] << np.uint64(bits * j)
    return words.astype(np.uint32)


def roundtrip(x, spec):
    return np.asarray(kq.roundtrip(jnp.asarray(x, jnp.float32), spec))


# ---- quantizers and packing ----------------------------------------------------------------------
def test_golden_cases():
    tok2 = kq.KVQuant("token", bits=2)
    qh2 = kq.KVQuant("token", bits=2, zero_point="clamped")
    np.testing.assert_array_equal(roundtrip([[0, 1, 2, 3]], tok2), [[0, 1, 2, 3]])
    np.testing.assert_array_equal(roundtrip([[2, 3, 4, 5]], tok2), [[2, 3, 4, 5]])  # float min
    np.testing.assert_array_equal(roundtrip([[0, 1, 2, 3]], qh2), [[0, 1, 2, 3]])
    np.testing.assert_allclose(roundtrip([[2, 3, 4, 5]], qh2), [[2, 3, 3, 3]])  # authors' clip
    np.testing.assert_allclose(roundtrip([[5, 5, 5, 5]], qh2), [[1e-5] * 4], rtol=2e-3)
    np.testing.assert_allclose(np_qhitter([[2, 3, 4, 5]], 2), [[2, 3, 3, 3]])  # the reference
    for spec in (tok2, kq.KVQuant("token", bits=4), kq.KVQuant("int8")):
        np.testing.assert_array_equal(roundtrip(np.zeros((2, 4)), spec), 0.0)  # all zero
        if spec.format == "token":  # a constant group: scale 0, stored as its minimum
            np.testing.assert_array_equal(roundtrip(np.full((2, 4), 5.0), spec), 5.0)
    # int8 is symmetric: a constant row is 127 steps of a float16 scale, within half a step
    np.testing.assert_allclose(roundtrip(np.full((2, 4), 5.0), kq.KVQuant("int8")), 5.0,
                               rtol=1 / 254)


@pytest.mark.parametrize("bits,G", [(2, 8), (3, 16), (4, 4), (8, 16)])
def test_token_quantizer_matches_numpy(bits, G):
    x = np.random.default_rng(bits).standard_normal((3, 5, 16)).astype(np.float32) * 3
    want, want_q = np_token(x, bits, G)
    spec = kq.KVQuant("token", bits=bits, group=G)
    q, _, _ = kq.quantize(jnp.asarray(x), spec)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_allclose(roundtrip(x, spec), want, atol=1e-6, rtol=1e-6)
    assert np.abs(want - x).max() <= (x.max() - x.min()) / (2 ** bits - 1)  # within a step


@pytest.mark.parametrize("spec", [kq.KVQuant("int8"), kq.KVQuant("token", bits=4, group=8)])
def test_tiny_values_keep_a_float16_normal_step(spec):
    """A row or group whose scale would fall below float16's normals (2^-14) keeps that
    smallest normal as its step: stored to within half of it, never zeroed."""
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32) * 1e-4
    err = np.abs(roundtrip(x, spec) - x).max()
    assert 0 < np.abs(x).max() and err <= 2.0 ** -15 + 1e-7, err


def test_int8_and_clamped_match_numpy():
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_allclose(roundtrip(x, kq.KVQuant("int8")), np_int8(x), atol=1e-6)
    got = roundtrip(x + 2.0, kq.KVQuant("token", bits=4, zero_point="clamped",
                                        scale_dtype="float16"))
    np.testing.assert_allclose(got, np_qhitter(x + 2.0, 4), atol=2e-3)  # float16 scale


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip_and_layout(bits):
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, (3, 2, 64)).astype(np.uint8)
    words = kq.pack(jnp.asarray(codes), bits)
    np.testing.assert_array_equal(np.asarray(words), np_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(kq.unpack(words, bits, 64)), codes)


def test_on_grid_data_is_stored_exactly():
    """Values already on the 8-bit grid come back unchanged: int8 (symmetric) and token-8."""
    ints = np.random.default_rng(1).integers(-127, 128, (2, 2, 5, 16)).astype(np.float32)
    ints[..., 0] = 127  # the row maximum fixes the scale at 1
    np.testing.assert_array_equal(roundtrip(ints * 0.5, kq.KVQuant("int8")), ints * 0.5)
    grid = ints + 127  # [0, 254]; each row spans the full 8-bit range: min 0, max 255
    grid[..., 1], grid[..., 2] = 0, 255
    np.testing.assert_array_equal(roundtrip(grid * 0.25, kq.KVQuant("token", bits=8)),
                                  grid * 0.25)


# ---- the cache -----------------------------------------------------------------------------------
def _naive(spec, sinks, window, tokens):
    """The authors' list cache, storing each non-sink token's K and V quantized (numpy)."""
    store = {"int8": np_int8,
             "token": lambda x: np_token(x, spec.bits, spec.group or x.shape[-1])[0]}[spec.format]
    ref = NaiveStream(PARAMS, CFG, sinks, window, kv_store=store)
    return ref.run(tokens)


@pytest.mark.parametrize("spec", [kq.KVQuant("int8"), kq.KVQuant("token", bits=2)])
def test_streamed_chunks_equal_the_quantizing_list_cache(spec):
    """StreamingLLM 2+9, fed in chunks of 7 (longer than the window, partly padded): every
    token's logits equal the naive list cache that quantizes each non-sink token as it comes."""
    S, W, N = 2, 9, 40
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (N,), 0, CFG.vocab_size))
    want = _naive(spec, S, W, tokens)
    cache = jaxllm.init_cache(CFG, 1, S, W, kv_quant=spec)
    got = []
    for s in range(0, N, 7):
        lg, cache = jaxllm.forward(PARAMS, CFG, tokens[None, s:s + 7], cache)
        got.append(np.asarray(lg[0]))
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-4, rtol=1e-4)
    # and the quantization mattered: the float cache differs
    flt = NaiveStream(PARAMS, CFG, S, W).run(tokens)
    assert np.abs(flt - want).max() > 1e-5


def test_chunked_prefill_equals_token_by_token():
    spec = kq.KVQuant("token", bits=4, group=8)
    tokens = np.asarray(jax.random.randint(jax.random.key(5), (2, 30), 0, CFG.vocab_size))
    a, ca = jaxllm.forward(PARAMS, CFG, tokens, jaxllm.init_cache(CFG, 2, 4, 12, kv_quant=spec))
    cb = jaxllm.init_cache(CFG, 2, 4, 12, kv_quant=spec)
    b = []
    for t in range(30):
        lg, cb = jaxllm.forward(PARAMS, CFG, tokens[:, t:t + 1], cb)
        b.append(lg)
    np.testing.assert_allclose(np.concatenate(b, 1), a, atol=2e-5, rtol=1e-5)
    # The same codes stored, up to float rounding of K and V themselves (a chunk's matmuls round
    # differently from a token's): at most a rare code one step apart.
    for sa, sb in zip(ca.k + ca.v, cb.k + cb.v):
        qa, qb = (np.asarray(kq.unpack(s.codes, 4, 16)).astype(int) for s in (sa, sb))
        assert np.abs(qa - qb).max() <= 1 and (qa != qb).mean() < 0.01
        np.testing.assert_allclose(np.asarray(sa.scale, np.float32),
                                   np.asarray(sb.scale, np.float32), rtol=2e-3)


def test_generate_runs_quantized():
    """The jitted loop and the Python loop agree on a quantized window cache that wraps (the
    other policies' logits are covered above)."""
    spec = kq.KVQuant("token", bits=4)
    prompt = jnp.asarray([[1, 2, 3, 4, 5]])
    sc = jaxllm.SamplingConfig(max_new_tokens=6)
    make = lambda: jaxllm.init_cache(CFG, 1, 0, 4, kv_quant=spec)  # noqa: E731
    res = jaxllm.generate(PARAMS, CFG, prompt, make(), sc)
    ref = jaxllm.generate_python(PARAMS, CFG, prompt, make(), sc)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))


def test_no_recompilation_and_bounded_counters_when_quantized():
    spec = kq.KVQuant("token", bits=2)
    cache = jaxllm.init_cache(CFG, 1, 4, 60, kv_quant=spec)
    chunk = np.zeros((1, 500), np.int32)
    for _ in range(2):
        _, cache = jaxllm.forward(PARAMS, CFG, chunk, cache)
    def stream():
        nonlocal cache
        for i in range(20):  # another 10K tokens
            logits, cache = jaxllm.forward(PARAMS, CFG, chunk + i % 7, cache)
        logits.block_until_ready()
    assert backend_compiles(stream) == []
    assert int(cache.length[0]) == 64 and int(cache.head[0]) == (11000 - 4) % 60


def test_counters_near_2_31_when_quantized():
    """As test_cache.test_counters_near_2_31: a quantized ring laid out as after 2**31 - 4
    tokens gives the same logits as the same content after S+W+3 tokens."""
    spec, S, W = kq.KVQuant("token", bits=4, group=8), 2, 5
    toks = np.asarray(jax.random.randint(jax.random.key(7), (1, S + W + 13), 0, 64))
    _, a = jaxllm.forward(PARAMS, CFG, toks[:, :S + W + 3],
                          jaxllm.init_cache(CFG, 1, S, W, kv_quant=spec))
    n_a, n_b = S + W + 3, 2**31 - 4
    slot = lambda t: t if t < S else S + (t - S) % W  # noqa: E731
    perm = [0] * W
    for d in range(1, W + 1):
        perm[slot(n_b - d) - S] = slot(n_a - d) - S
    idx = np.r_[np.arange(S), S + np.asarray(perm)]
    move = lambda st: st.replace(codes=st.codes[:, :, idx], scale=st.scale[:, :, idx],  # noqa
                                 offset=st.offset[:, :, idx])
    b = a.replace(k=tuple(map(move, a.k)), v=tuple(map(move, a.v)),
                  head=jnp.asarray([(n_b - S) % W], jnp.int32))
    for i in range(10):
        la, a = jaxllm.forward(PARAMS, CFG, toks[:, n_a + i:n_a + i + 1], a)
        lb, b = jaxllm.forward(PARAMS, CFG, toks[:, n_a + i:n_a + i + 1], b)
        np.testing.assert_allclose(lb, la, atol=1e-6)


def test_memory_measured_from_the_arrays():
    """Group 32, 4,096 slots: 4 bits <= 0.33x and 2 bits <= 0.20x of a float16 cache (codes,
    scales, minima and the full-precision sinks included)."""
    cfg = dataclasses.replace(CFG, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64)
    ref = kv_bytes(jaxllm.init_cache(cfg, 1, 4, 4092, dtype=jnp.float16))
    ratio = {b: kv_bytes(jaxllm.init_cache(cfg, 1, 4, 4092, dtype=jnp.float16,
                                           kv_quant=kq.KVQuant("token", bits=b, group=32))) / ref
             for b in (2, 4, 8)}
    assert ratio[4] <= 0.33 and ratio[2] <= 0.20, ratio
    assert ratio[8] < 0.6


@pytest.mark.parametrize("kw,msg", [
    (dict(format="token", bits=5), "kv bits 5 is not supported"),
    (dict(format="int8", bits=4), "kv bits 4 is not supported"),
    (dict(format="kiwi"), "kv_quant format 'kiwi' is unknown"),
    (dict(format="token", bits=4, group=-1), "kv group must be >= 0"),
])
def test_bad_settings_name_the_parameter(kw, msg):
    with pytest.raises(ValueError, match=msg):
        kq.KVQuant(**kw)


def test_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="kv group 12 must divide head_dim 16"):
        jaxllm.init_cache(CFG, 1, 2, 8, kv_quant=kq.KVQuant("token", bits=4, group=12))


# ---- KIVI ----------------------------------------------------------------------------------------
class KiviList:
    """The authors' KIVI buffers for one layer, as a list cache (docs/METHODS.md §5): keys stay in
    full precision until R have accumulated since the last flush, then are quantized per channel
    in groups of G tokens; values are quantized per token (G channels) once R newer tokens
    exist; both after the step's attention. Sinks stay in full precision; eviction drops the
    oldest non-sink entry (its key still counts in its block's flush, as in a ring buffer)."""

    def __init__(self, bits, G, R):
        self.bits, self.G, self.R = bits, G, R
        self.entries, self.block, self.n = [], [], 0  # block: (entry, k) since the last flush

    def add(self, k, v, sink):
        e = {"k": k, "v": v, "kq": None, "vq": None, "sink": sink, "u": None if sink else self.n}
        self.entries.append(e)
        if not sink:
            self.block.append(e)
            self.n += 1

    def evict(self):
        del self.entries[next(i for i, e in enumerate(self.entries) if not e["sink"])]

    def view(self):
        ks = np.stack([e["k"] if e["kq"] is None else e["kq"] for e in self.entries])
        vs = np.stack([e["v"] if e["vq"] is None else e["vq"] for e in self.entries])
        return ks, vs

    def after(self):
        if len(self.block) == self.R:  # key flush: [R, heads, D] per channel over G tokens
            keys = np.stack([e["k"] for e in self.block])
            H, D = keys.shape[1:]
            per_chan = keys.reshape(self.R // self.G, self.G, H, D).transpose(0, 2, 3, 1)
            deq = np_token(per_chan, self.bits, self.G)[0].transpose(0, 3, 1, 2)
            for e, k_hat in zip(self.block, deq.reshape(self.R, H, D)):
                e["kq"] = k_hat
            self.block = []
        for e in self.entries:  # value flush: a sliding window of exactly R in full precision
            if not e["sink"] and e["vq"] is None and e["u"] < self.n - self.R:
                e["vq"] = np_token(e["v"], self.bits, self.G)[0]

    def counts(self):
        held = [e for e in self.entries if not e["sink"]]
        return {"keys_quantized": sum(e["kq"] is not None for e in held),
                "keys_full": sum(e["kq"] is None for e in held),
                "values_quantized": sum(e["vq"] is not None for e in held),
                "values_full": sum(e["vq"] is None for e in held)}


def test_kivi_buffer_counts_after_prefill_and_decode():
    """docs/METHODS.md §5: T=100, R=32, G=32: after prefill 96 keys quantized and 4 full, 68 values
    quantized and 32 full; after 28 decode steps 128 keys quantized and 0 full, values 32 full."""
    spec = kq.KVQuant("kivi", bits=4, group=32, residual=32)
    cfg = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=128, num_layers=1, num_heads=4,
                                   num_kv_heads=2, intermediate_size=96)  # head_dim 32
    params = jaxllm.init_params(cfg, jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (1, 128), 0, 64))
    ref = NaiveStream(params, cfg, 0, None, kv_list=lambda: KiviList(4, 32, 32))
    ref.run(tokens[0, :100])
    want = {"keys_quantized": 96, "keys_full": 4, "values_quantized": 68, "values_full": 32}
    assert ref.lists[0].counts() == want
    cache = jaxllm.init_cache(cfg, 1, 0, 256, ring=False, kv_quant=spec)
    _, cache = jaxllm.forward(params, cfg, tokens[:, :100], cache)  # prefill in one chunk
    assert kivi_counts(cache) == want
    for t in range(100, 128):
        _, cache = jaxllm.forward(params, cfg, tokens[:, t:t + 1], cache)
        ref.step(int(tokens[0, t]))
    want = {"keys_quantized": 128, "keys_full": 0, "values_quantized": 96, "values_full": 32}
    assert kivi_counts(cache) == want == ref.lists[0].counts()


@pytest.mark.parametrize("S,W,bits", [(2, 16, 2), (0, 8, 4), (2, 13, 2)])
def test_kivi_stream_equals_the_authors_buffers(S, W, bits):
    """Token by token through a StreamingLLM ring that wraps several times: every logit equals
    the list cache with KIVI's buffers and flush rules (G=4, R=8), also for a window that R
    does not divide (13: the store's own ring of 16 slots, the 3 oldest never visible)."""
    spec = kq.KVQuant("kivi", bits=bits, group=4, residual=8)
    tokens = np.asarray(jax.random.randint(jax.random.key(S + W), (60,), 0, CFG.vocab_size))
    want = NaiveStream(PARAMS, CFG, S, W, kv_list=lambda: KiviList(bits, 4, 8)).run(tokens)
    cache = jaxllm.init_cache(CFG, 1, S, W, kv_quant=spec)
    got = []
    for t in range(len(tokens)):
        lg, cache = jaxllm.forward(PARAMS, CFG, tokens[None, t:t + 1], cache)
        got.append(np.asarray(lg[0, 0]))
    np.testing.assert_allclose(np.stack(got), want, atol=2e-4, rtol=1e-4)


def test_kivi_chunks_attend_in_full_then_store_what_steps_store():
    """The rule for chunks: a chunk attends to the cache as it was plus its own tokens in full
    precision (the authors' fp16 prefill), then quantizes. So a prompt of at most W tokens in
    one chunk gets exactly the float cache's logits; a longer one goes in blocks of W (see
    model.apply), each seeing the earlier blocks as stored. What is stored follows the same
    flush rule either way: layer 0's keys and values (which depend on the token alone) are the
    same after one chunk as after token-by-token steps; deeper layers differ because their
    inputs saw full-precision attention inside the chunk."""
    spec = kq.KVQuant("kivi", bits=2, group=4, residual=8)
    tokens = np.asarray(jax.random.randint(jax.random.key(9), (1, 20), 0, CFG.vocab_size))
    short, _ = jaxllm.forward(PARAMS, CFG, tokens[:, :8],
                              jaxllm.init_cache(CFG, 1, 2, 8, kv_quant=spec))
    flt, _ = jaxllm.forward(PARAMS, CFG, tokens[:, :8], jaxllm.init_cache(CFG, 1, 2, 8))
    np.testing.assert_allclose(short, flt, atol=1e-5)
    _, ca = jaxllm.forward(PARAMS, CFG, tokens, jaxllm.init_cache(CFG, 1, 2, 8, kv_quant=spec))
    cb = jaxllm.init_cache(CFG, 1, 2, 8, kv_quant=spec)
    for t in range(20):
        _, cb = jaxllm.forward(PARAMS, CFG, tokens[:, t:t + 1], cb)
    lay = jaxllm.kv.cache.chunk_layout(ca, jnp.ones((1,), jnp.int32), 1)
    for x, y in ((ca.k[0], cb.k[0]), (ca.v[0], cb.v[0])):
        np.testing.assert_allclose(np.asarray(x.read(lay)), np.asarray(y.read(lay)), atol=1e-5)
    assert kivi_counts(ca) == kivi_counts(cb)


def test_kivi_memory_and_settings():
    cfg = dataclasses.replace(CFG, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64)
    ref = kv_bytes(jaxllm.init_cache(cfg, 1, 4, 4092, dtype=jnp.float16))
    for window in (4092, 1020, 252):  # any window: R = 32 need not divide it
        cache = jaxllm.init_cache(cfg, 1, 4, window, dtype=jnp.float16,
                                  kv_quant=kq.KVQuant("kivi", 2, 32, residual=32))
        assert cache.capacity == 4 + window and cache.k[0].codes.shape[2] == -(-window // 32) * 32
    got = kv_bytes(jaxllm.init_cache(cfg, 1, 4, 4092, dtype=jnp.float16,
                                     kv_quant=kq.KVQuant("kivi", 2, 32, residual=32)))
    assert got / ref <= 0.21, got / ref
    with pytest.raises(ValueError, match="kv residual 16 must be >= the kv group 32"):
        kq.KVQuant("kivi", 2, 32, residual=16)
    with pytest.raises(ValueError, match="kv group 24 must divide the kv residual 32"):
        kq.KVQuant("kivi", 2, 24, residual=32)
    with pytest.raises(ValueError, match="kv bits 3 is not supported by the kivi format"):
        kq.KVQuant("kivi", 3, 32)


@pytest.mark.parametrize("args,msg", [
    (["--kv-quant", "token", "--kv-bits", "5"], "--kv-bits 5 is not supported"),
    (["--kv-quant", "token", "--kv-group", "7"], "--kv-group 7 must divide head_dim 48"),
    (["--kv-quant", "kivi", "--kv-residual", "8"], "--kv-residual 8 must be >= the --kv-group 16"),
])
def test_cli_kv_errors_are_one_line_naming_the_flag(args, msg, capsys):
    from jaxllm.cli import main
    assert main(["ppl", "--model", "embedded", "--max-tokens", "50", "--quiet", "--cache", "68"]
                + args) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err
