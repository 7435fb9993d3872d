"""H2O and Q-Hitter (jaxllm.kv.evict) against independent references: a numpy port of the H2O
authors' layer-wise cache fed attention tensors directly (docs/METHODS.md §4), hand-built
Q-Hitter cases (§2 "Test"), the naive list cache of tests/naive.py implementing the same
policy token by token, the full-attention forward for a prompt fed in one chunk, and StreamingLLM
(H2O without heavy hitters is a sink + window cache)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import LLAMA, NEOX, backend_compiles
from naive import NaiveEvictStream

import jaxllm
from jaxllm.kv import evict
from jaxllm.kv.evict import Evict
from jaxllm.kv.quantized import KVQuant, roundtrip
from jaxllm.policy import H2O, KVStorage, QHitter, StreamingLLM, policy_of

PARAMS = {"neox": jaxllm.init_params(NEOX, jax.random.key(0)),
          "llama": jaxllm.init_params(LLAMA, jax.random.key(0))}
CFGS = {"neox": NEOX, "llama": LLAMA}


# ---- the authors' H2OKVCache_LayerWise, ported to numpy (bsz 1, MHA) ----------------------------

class AuthorsH2O:
    """``__call__(attn [1, H, q, k])`` after every forward: scores = column sums over the batch and
    the query rows; the previous scores are added to the first k - q columns; above hh + recent,
    keep per head the top-hh of scores[:, :k - recent] (sorted) and the last recent. ``kept`` [H]
    lists the stream index of every kept token, in cache order."""

    def __init__(self, hh, recent):
        self.hh, self.recent, self.score, self.kept = hh, recent, None, None

    def __call__(self, attn, new_tokens):
        q = attn.shape[2]
        s = attn.sum(0).sum(1)  # [H, k]
        if self.score is not None:
            s[:, :-q] += self.score
        kept = np.array([list(k) + list(new_tokens) for k in self.kept]) if self.kept is not None \
            else np.tile(np.asarray(new_tokens), (s.shape[0], 1))
        k = s.shape[1]
        if k > self.hh + self.recent:
            sel = np.sort(np.argsort(-s[:, :k - self.recent], axis=1)[:, :self.hh], axis=1)
            keep = np.concatenate([sel, np.tile(np.arange(k - self.recent, k), (s.shape[0], 1))], 1)
            s, kept = np.take_along_axis(s, keep, 1), np.take_along_axis(kept, keep, 1)
        self.score, self.kept = s, kept


def _softmax_rows(x, mask):
    x = np.where(mask, x, -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_port_of_authors_cache_fed_attention_directly():
    """H=2, hh=2, recent=2: a 6x6 causal prefill, then 6 decode rows. Token by token, jaxllm's
    kept set (per head, as stream indices) and scores equal the port's."""
    rng = np.random.default_rng(0)
    H, hh, rec, T0 = 2, 2, 2, 6
    spec = Evict("h2o", hh, rec)
    port = AuthorsH2O(hh, rec)
    attn = _softmax_rows(rng.normal(size=(1, H, T0, T0)) * 3, np.tril(np.ones((T0, T0), bool)))
    port(attn.copy(), range(T0))
    sc = evict.empty_scores(1, H, hh + rec + 1)
    lay = evict.layout(jnp.zeros(1, jnp.int32), jnp.array([T0]), T0, 0, hh + rec, spec)
    sc, idx = evict.compress(sc, jnp.zeros((1, H, hh + rec + 1)),
                             jnp.asarray(attn.sum(2), jnp.float32), jnp.zeros((1, H, T0, 2)), lay,
                             spec)
    # which stream token each slot holds (the test's own bookkeeping): entries C+1+t are chunk t
    tok = np.where(np.asarray(idx)[0] >= hh + rec + 1, np.asarray(idx)[0] - (hh + rec + 1), -1)

    def check():
        rank = np.asarray(sc.rank)[0]
        for h in range(H):
            slots = np.argsort(np.where(rank[h] >= 0, rank[h], 99))[:len(port.kept[h])]
            assert list(tok[h][slots]) == list(port.kept[h])  # same tokens, same order
            np.testing.assert_allclose(np.asarray(sc.acc)[0, h][slots], port.score[h], rtol=1e-5)

    check()
    n = hh + rec
    for t in range(T0, T0 + 6):
        row = _softmax_rows(rng.normal(size=(1, H, 1, n + 1)) * 3, True)  # over kept + new
        port(row.copy(), [t])
        free = np.asarray(sc.free)[0]
        tok[np.arange(H), free] = t
        sc = evict.written(sc, jnp.array([n]), jnp.array([True]), jnp.zeros((1, H, 2)))
        # the same row, laid out by our slots: kept tokens in stream order, then the new one
        rank = np.asarray(sc.rank)[0]
        probs = np.zeros((1, H, 1, 1, n + 1), np.float32)
        for h in range(H):
            probs[0, h, 0, 0] = row[0, h, 0][rank[h]]  # slot s holds the rank[s]-th key
        sc = evict.decode_update(sc, jnp.asarray(probs), jnp.array([n]), jnp.array([True]),
                                 spec, 0)
        tok = np.where(np.asarray(sc.rank)[0] >= 0, tok, -1)
        check()


# ---- Q-Hitter's score by hand ---------------------------------------------------------------------

def _one_eviction(acc, err, spec, S=0):
    """Slots 0..4 hold five tokens (ranks 0..4, the last recent), full at C = 4: which is evicted."""
    C1 = len(acc)
    sc = evict.Scores(acc=jnp.asarray([[acc]], jnp.float32),
                      rank=jnp.arange(C1, dtype=jnp.int32)[None, None],
                      err=jnp.asarray([[err]], jnp.float32), free=jnp.zeros((1, 1), jnp.int32))
    out = evict.decode_update(sc, jnp.zeros((1, 1, 1, 1, C1)), jnp.array([C1 - 1]),
                              jnp.array([True]), spec, S)
    return int(np.flatnonzero(np.asarray(out.rank)[0, 0] < 0)[0])


TOP_MASK = jax.jit(evict.top_mask)  # k traced too: one compilation for every example


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-2.5, -0.0, 0.0, 1e-30, 0.25, 0.25, 3.0, 7.5]),
                          st.booleans()), min_size=1, max_size=24),
       st.integers(1, 24), st.floats(-4, 4, width=32, allow_subnormal=False))
def test_top_mask_is_the_stable_top_k(entries, k, jitter):
    """Q-Hitter's attention-only share: the k largest valid entries, ties to the lower index
    (numpy's stable sort as the reference), negative values, zeros of either sign included.
    Subnormal numbers are left out: XLA:CPU flushes them to zero (a -1e-44 ties with -0.0
    there, and numpy orders them; found by a CI run)."""
    x = np.zeros(24, np.float32)
    valid = np.zeros(24, bool)  # padded to one shape with invalid entries
    for i, (v, ok) in enumerate(entries):
        x[i], valid[i] = (v if i % 3 else v + jitter), ok
    idx = np.flatnonzero(valid)
    ref = np.zeros(len(x), bool)
    ref[idx[np.argsort(-x[idx], kind="stable")[:k]]] = True
    got = np.asarray(TOP_MASK(jnp.asarray(x)[None], jnp.asarray(valid)[None], k))[0]
    np.testing.assert_array_equal(got, ref)


def test_qhitter_prefers_a_quant_friendly_token_over_an_outlier():
    # slot 1: slightly more attention than slot 2 but a large quantization error (an outlier);
    # slot 2: a little less attention, almost no error. Slot 0 is the clear heavy hitter.
    acc = [5.0, 1.1, 1.0, 0.2, 0.9]
    err = [[0.1, 0.1], [2.0, 2.0], [0.05, 0.05], [0.1, 0.1], [0.1, 0.1]]
    h2o = Evict("h2o", heavy=3, recent=1)
    assert _one_eviction(acc, err, h2o) == 3  # least attention
    # λ = 0.5: combo(3) = 0.5·0 + 0.5·(1 - 0.026) is the best but slot 1 scores
    # 0.5·0.19 + 0.5·0 = 0.095, the lowest: the outlier goes although its attention beats slot 2's.
    assert _one_eviction(acc, err, Evict("qhitter", 3, 1, lam=0.5)) == 1
    assert _one_eviction(acc, err, Evict("qhitter", 3, 1, lam=1.0)) == 3  # λ = 1 is H2O
    # the attention-only share keeps slot 1 (second-best attention among candidates 0..3 is 1.1):
    assert _one_eviction(acc, err, Evict("qhitter", 3, 1, attn_only=2, lam=0.5)) != 1


def test_lambda_one_equals_h2o():
    """λ = 1 (with any attention-only share) keeps what H2O keeps: identical logits and scores
    over a stream fed in chunks and token by token."""
    cfg, params = LLAMA, PARAMS["llama"]
    toks = np.random.default_rng(1).integers(0, 64, (1, 36))
    out = []
    for spec in (Evict("h2o", 6, 3), Evict("qhitter", 6, 3, attn_only=2, lam=1.0)):
        cache = jaxllm.init_cache(cfg, 1, sinks=1, evict_by=spec)
        a, cache = jaxllm.forward(params, cfg, toks[:, :20], cache)
        logits = [a]
        for t in range(20, 36):
            lg, cache = jaxllm.forward(params, cfg, toks[:, t:t + 1], cache)
            logits.append(lg)
        out.append((np.concatenate(logits, 1), np.asarray(cache.state[1].acc)))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    # The two policies compile to different programs, and the scores are sums of attention
    # probabilities: XLA:CPU sums them in one order in both, XLA:GPU picks a reduction's order
    # per fusion (an H100 gave 1 ulp apart, 1.9e-6 at 10.1), so there they agree to a few ulp.
    rtol = 0 if jax.default_backend() == "cpu" else 1e-6
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=rtol, atol=0)


# ---- whole-model streams against the naive list cache ---------------------------------------------

@pytest.mark.parametrize("family", ["neox", "llama"])
def test_streamed_logits_equal_naive_list_cache(family):
    """Batch 2, rows of different lengths (row 1 pauses on some steps), 1-token chunks: every
    logit equals NaiveEvictStream's, for H2O (float cache) and Q-Hitter (4-bit codes, λ 0.5)."""
    cfg, params = CFGS[family], PARAMS[family]
    rng = np.random.default_rng(2)
    N, S = 26, 2
    toks = rng.integers(0, cfg.vocab_size, (2, N))
    live = np.stack([np.ones(N, bool), rng.random(N) < 0.7])  # row 1 skips ~30% of the steps
    q4 = KVQuant("token", bits=4, group=0)
    store = lambda x: np.asarray(roundtrip(jnp.asarray(x, jnp.float32), q4), np.float64)  # noqa
    for spec, kq in ((Evict("h2o", 4, 3), None), (Evict("qhitter", 5, 2, 2, 0.5), q4)):
        cache = jaxllm.init_cache(cfg, 2, sinks=S, evict_by=spec, kv_quant=kq)
        got = [[], []]
        for t in range(N):
            lg, cache = jaxllm.forward(params, cfg, toks[:, t:t + 1], cache,
                                       live[:, t].astype(np.int32))
            for b in range(2):
                if live[b, t]:
                    got[b].append(np.asarray(lg[b, 0]))
        for b in range(2):
            row = toks[b][live[b]]
            ref = NaiveEvictStream(params, cfg, S, spec.heavy, spec.recent, spec.lam,
                                   spec.attn_only, None if kq is None else store).run(row)
            np.testing.assert_allclose(np.stack(got[b]), ref, atol=2e-5, rtol=1e-4)
    # ... and the policy matters: a sink + window cache of the same size predicts differently
    win, _ = jaxllm.forward(params, cfg, toks[:1], jaxllm.init_cache(cfg, 1, sinks=S, window=8))
    assert np.abs(np.asarray(win[0, 10:]) - np.stack(got[0])[10:]).max() > 1e-3


def test_no_heavy_hitters_is_streaming_llm():
    """H2O with S sinks, H = 0 and R recent attends to exactly StreamingLLM S+(R+1)'s tokens at
    the same in-cache positions: the same logits token by token."""
    cfg, params = NEOX, PARAMS["neox"]
    toks = np.random.default_rng(3).integers(0, 64, (2, 30))
    ref, _ = jaxllm.forward(params, cfg, toks, jaxllm.init_cache(cfg, 2, sinks=2, window=6))
    cache = jaxllm.init_cache(cfg, 2, sinks=2, evict_by=Evict("h2o", 0, 5))
    got = []
    for t in range(30):
        lg, cache = jaxllm.forward(params, cfg, toks[:, t:t + 1], cache)
        got.append(lg)
    np.testing.assert_allclose(jnp.concatenate(got, 1), ref, atol=1e-5)


def test_prompt_in_one_chunk_attends_fully_then_keeps_the_top_columns():
    """The authors' prefill: a prompt fed in one call gets full causal attention (the plain
    forward's logits), then each layer and KV head keeps the top-H column sums of that attention
    (summed over the group's query heads) among all but the last R tokens, plus the last R."""
    cfg, params = LLAMA, PARAMS["llama"]
    T, H, R = 24, 5, 3
    toks = np.random.default_rng(4).integers(0, 64, (1, T))
    ref, _, state = jaxllm.model.apply(params, cfg, jnp.asarray(toks), mutable=["attention"])
    cache = jaxllm.init_cache(cfg, 1, sinks=0, evict_by=Evict("h2o", H, R))
    got, cache = jaxllm.forward(params, cfg, toks, cache)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    G = cfg.num_heads // cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        probs = np.asarray(state["attention"][f"layer_{layer}"]["attn"]["probs"])[0]  # [H, T, T]
        cols = probs.reshape(cfg.num_kv_heads, G, T, T).sum((1, 2))  # [KVH, T]
        for h in range(cfg.num_kv_heads):
            top = np.sort(np.argsort(-cols[h, :T - R])[:H])
            want = cols[h, np.concatenate([top, np.arange(T - R, T)])]
            sc = cache.state[layer]
            kept = np.asarray(sc.rank)[0, h] >= 0
            np.testing.assert_allclose(np.asarray(sc.acc)[0, h][kept], want, rtol=1e-5)


# ---- one jit, bounded state ----------------------------------------------------------------------

def test_generate_in_one_jit_equals_python_loop_without_recompiling():
    cfg, params = LLAMA, PARAMS["llama"]
    pc = QHitter(sinks=2, cache=14, heavy=8, recent=4)
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 9)))
    sc = jaxllm.SamplingConfig(max_new_tokens=24)
    res = jaxllm.generate(params, cfg, prompt, pc.make_cache(cfg, 2, 0), sc)
    ref = jaxllm.generate_python(params, cfg, prompt, pc.make_cache(cfg, 2, 0), sc)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))

    prompt2, cache2 = (prompt + 1) % 64, pc.make_cache(cfg, 2, 0)

    def again():  # a second stream of the same shapes: nothing compiles
        jaxllm.generate(params, cfg, prompt2, cache2, sc).tokens.block_until_ready()
    assert backend_compiles(again) == []
    # every counter stays below the slot count after 33 tokens through 15 slots
    cache = res.cache
    ints = [cache.length, cache.head] + [x for s in cache.state for x in (s.rank, s.free)]
    assert all(int(jnp.max(x)) <= cache.capacity for x in ints)
    assert int(cache.length.max()) == 14 and int(cache.state[0].rank.max()) == 13


# ---- budgets and errors ---------------------------------------------------------------------------

def test_budgets_as_counts_or_fractions():
    pc = H2O(heavy=0.1, recent=0.05).resolve(1000)
    assert (pc.heavy, pc.recent, pc.cache) == (100, 50, 150)
    assert pc.evict_spec() == Evict("h2o", 100, 50)
    assert pc.label == "H2O 0+100+50"
    q = QHitter(cache=200)  # the authors' 15% + 5% split, 7/15 by attention
    assert q.evict_spec() == Evict("qhitter", 150, 50, 70, 0.5)
    assert q.storage.quant == KVQuant("token", bits=4, group=0)
    cache = H2O(sinks=4, cache=132).make_cache(LLAMA, 1, 0)
    assert cache.capacity == 133 and cache.kind.evict == Evict("h2o", 64, 64)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache=100, heavy=80, recent=30), "exceed the cache"),
    (dict(heavy=1.5), "count .* or a fraction"),
    (dict(recent=-0.1), "count .* or a fraction"),
    (dict(method="qhitter", lam=1.2), r"lam \(λ\) must lie in \[0, 1\]"),
    (dict(method="streaming", heavy=10), "heavy applies to method h2o or qhitter, not streaming"),
    (dict(kv_quant=KVQuant("kivi", bits=2, group=16)), "KIVI"),
])
def test_bad_budgets_are_named(kwargs, match):
    kwargs = {"method": "h2o", **kwargs}
    with pytest.raises(ValueError, match=match):
        policy_of(**kwargs)


def test_settings_a_method_lacks_cannot_be_written():
    """Budgets on StreamingLLM, sinks on a plain window, a KV store for recompute: the variants
    have no such field, and the name-based builder refuses them by name."""
    with pytest.raises(TypeError):
        StreamingLLM(heavy=10)  # noqa
    with pytest.raises(TypeError):
        jaxllm.Window(sinks=4)  # noqa
    with pytest.raises(TypeError):
        jaxllm.Recompute(storage=KVStorage("bfloat16"))  # noqa
    with pytest.raises(ValueError, match="method window keeps no sink tokens"):
        policy_of("window", sinks=4)
    with pytest.raises(ValueError, match="no KV cache to quantize"):
        policy_of("recompute", kv_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"lam \(λ\) applies to method qhitter, not h2o"):
        policy_of("h2o", lam=0.3)
    with pytest.raises(ValueError, match="no method has a setting 'heavvy'; h2o's are sinks, "
                                         "cache, heavy, recent, storage"):
        policy_of("h2o", heavvy=3)
    # what is not given keeps the method's default: Q-Hitter's own 4-bit store, in bfloat16
    q = policy_of("qhitter", cache=200, kv_dtype="bfloat16")
    assert q.storage == KVStorage("bfloat16", KVQuant("token", bits=4, group=0))


def test_learned_positions_cannot_roll():
    from jaxllm.ppl import stream_score
    from test_reliability import OPT16
    params = jaxllm.init_params(OPT16, jax.random.key(0))
    for method in ("h2o", "qhitter"):
        with pytest.raises(ValueError, match="learned absolute positions, so it cannot stream"):
            stream_score(params, OPT16, np.arange(12), policy_of(method, cache=8))
    with pytest.raises(ValueError, match="cannot stream"):
        jaxllm.forward(params, OPT16, np.zeros((1, 3), np.int32),
                       jaxllm.init_cache(OPT16, 1, 0, evict_by=Evict("h2o", 2, 2)))


def test_cli_errors_are_one_line(capsys):
    from jaxllm.cli import main
    for args, msg in ((["--method", "h2o", "--cache", "100", "--heavy", "80", "--recent", "30"],
                       "exceed the cache"),
                      (["--method", "qhitter", "--lam", "2"],
                       "--lam: 2 is out of range: a finite number in [0, 1]")):
        assert main(["ppl", "--model", "random:pythia-tiny", "--quiet", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    assert main(["ppl", "--model", "embedded", "--method", "h2o", "--heavy", "1.5"]) == 2
    assert "fraction in (0, 1)" in capsys.readouterr().err


def test_evict_config_errors():
    with pytest.raises(ValueError, match="recent must be >= 1"):
        Evict("h2o", 4, 0)
    with pytest.raises(ValueError, match=r"attn_only .* must lie in \[0, heavy=4\]"):
        Evict("qhitter", 4, 2, attn_only=5)
    assert dataclasses.replace(Evict(), lam=0.0).lam == 0.0


def test_kv_shift_scores_are_attention_column_sums(tmp_path):
    """kv-shift's float scores equal the column sums of the plain forward's attention (per KV
    head); the CLI writes its JSON and plot."""
    from jaxllm.cli import main
    from jaxllm.evals.kv_shift import _scores
    cfg, params = LLAMA, PARAMS["llama"]
    ids = np.random.default_rng(6).integers(0, 64, 32)
    _, _, state = jaxllm.model.apply(params, cfg, jnp.asarray(ids[None]), mutable=["attention"])
    G = cfg.num_heads // cfg.num_kv_heads
    got = _scores(params, cfg, ids, KVQuant())
    for layer, (acc, err) in enumerate(got):
        probs = np.asarray(state["attention"][f"layer_{layer}"]["attn"]["probs"])[0]
        np.testing.assert_allclose(acc, probs.reshape(-1, G, 32, 32).sum((1, 2)), rtol=1e-5)
        assert not err.any()
    out = tmp_path / "kv"
    assert main(["eval", "kv-shift", "--model", "random:pythia-tiny", "--prompt-tokens", "32",
                 "--stream-tokens", "32", "--bits", "3", "--out", str(out)]) == 0
    import json
    rep = json.loads((tmp_path / "kv.json").read_text())
    assert set(rep["h2o_ppl"]) == {"float", "3-bit"} and (tmp_path / "kv.png").exists()
    assert all(0 <= r["overlap_3-bit"] <= 1 for r in rep["layers"])
