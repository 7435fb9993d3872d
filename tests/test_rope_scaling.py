"""RoPE scaling (YaRN, NTK, NTK-by-parts) and explicit positions, against the YaRN reference's
golden values (docs/METHODS.md §6), a numpy port of its formulas, and transformers itself."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.config import RopeScaling
from jaxllm.rope import inv_freq, yarn_range


def np_yarn(d, base, L_orig, s, beta_fast=32, beta_slow=1):
    """The reference (scaled_rope/LlamaYaRNScaledRotaryEmbedding.py), docs/METHODS.md §6:
    inv_i = θ_i (1 - ramp_i) + θ_i / s · ramp_i, mscale = 0.1 ln s + 1."""
    theta = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    corr = lambda r: d * math.log(L_orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / ((high - low) or 0.001), 0, 1)
    return theta * (1 - ramp) + theta / s * ramp, 0.1 * math.log(s) + 1, (low, high)


@pytest.mark.parametrize("L,want", [(4096, (20, 46)), (2048, (16, 41)), (8192, (25, 50))])
def test_yarn_ramp_golden_values(L, want):
    assert yarn_range(128, 1e4, L) == want == np_yarn(128, 1e4, L, 16)[2]


@pytest.mark.parametrize("s,want", [(8, 1.20794), (16, 1.27726), (32, 1.34657)])
def test_yarn_temperature_golden_values(s, want):
    assert RopeScaling("yarn", s, original_max_len=4096).attention_scale == pytest.approx(
        want, abs=1e-5)
    assert RopeScaling("ntk-by-parts", s, original_max_len=4096).attention_scale == 1.0


def test_yarn_frequencies_match_the_reference():
    got = np.asarray(inv_freq(128, 1e4, RopeScaling("yarn", 16, original_max_len=4096),
                              jnp.ones((1,), jnp.int32)))[0]
    want, _, _ = np_yarn(128, 1e4, 4096, 16)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    theta = np.asarray(inv_freq(128, 1e4, None, jnp.ones((1,), jnp.int32)))[0]
    np.testing.assert_array_equal(got[:21], theta[:21])  # extrapolated: untouched
    np.testing.assert_array_equal(got[46:], theta[46:] / 16)  # interpolated: θ / s


def test_static_ntk_is_a_larger_base():
    got = inv_freq(64, 1e4, RopeScaling("ntk", 4.0), jnp.ones((1,), jnp.int32))
    want = 1.0 / (1e4 * 4.0 ** (64 / 62)) ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-5)


@pytest.mark.parametrize("kw,msg", [
    (dict(kind="yarn", factor=4.0), "yarn rope scaling needs original_max_len"),
    (dict(kind="ntk-by-parts", factor=4.0), "ntk-by-parts rope scaling needs original_max_len"),
    (dict(kind="rope-magic", factor=4.0), "unknown rope scaling 'rope-magic'"),
    (dict(kind="yarn", factor=4.0, original_max_len=16, beta_fast=1, beta_slow=2),
     "beta_fast > beta_slow"),
])
def test_bad_scaling_is_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RopeScaling(**kw)


# ---- against transformers ------------------------------------------------------------------------
torch = pytest.importorskip("torch")
import transformers as tf  # noqa: E402

import convert  # noqa: E402


def _llama(rope):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, initializer_range=0.2,
                         max_position_embeddings=64, rope_parameters=rope, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    return tf.LlamaForCausalLM(cfg).eval()


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1e4)


@pytest.mark.parametrize("rope", [YARN, dict(YARN, attention_factor=1.0),
                                  dict(YARN, beta_fast=8.0, beta_slow=2.0)],
                         ids=["yarn", "ntk-by-parts", "yarn-betas"])
def test_yarn_llama_matches_transformers(rope):
    model = _llama(rope)
    cfg, params = convert.from_hf(model)
    assert cfg.rope_scaling.kind == ("ntk-by-parts" if rope.get("attention_factor") == 1.0
                                     else "yarn")
    tokens = np.random.default_rng(0).integers(0, 64, (2, 48))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got, _ = jaxllm.forward(params, cfg, tokens)
    assert np.abs(np.asarray(got) - want).max() <= 1e-4
    out = convert.config_to_hf(cfg)["rope_parameters"]
    assert out["rope_type"] == "yarn" and out["original_max_position_embeddings"] == 16
    if rope is not YARN:
        return  # greedy decoding once (the logits above already pin the other settings)
    # 32 greedy tokens past the original context
    with torch.no_grad():
        hf = model.generate(torch.from_numpy(tokens[:1, :8]), max_new_tokens=32, do_sample=False,
                            min_new_tokens=32)[0, 8:].numpy()
    res = jaxllm.generate(params, cfg, tokens[:1, :8], jaxllm.init_cache(cfg, 1, 0, 40,
                                                                         ring=False),
                          jaxllm.SamplingConfig(max_new_tokens=32))
    np.testing.assert_array_equal(np.asarray(res.tokens[0]), hf)


def test_explicit_positions_match_transformers_position_ids():
    """forward(..., positions=p) is the model reading the tokens at positions p, as
    transformers' position_ids (PoSE's skipped positions)."""
    model = _llama(YARN)
    cfg, params = convert.from_hf(model)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 12))
    pos = np.stack([np.r_[0:5, 30:37], np.r_[0:3, 9:18]])
    with torch.no_grad():
        want = model(torch.from_numpy(tokens), position_ids=torch.from_numpy(pos)).logits.numpy()
    got, _ = jaxllm.forward(params, cfg, tokens, positions=pos)
    assert np.abs(np.asarray(got) - want).max() <= 1e-4


def test_positions_shift_invariance_and_errors():
    """RoPE is relative: every position moved by the same offset gives the same logits (the
    YaRN model of the test above, the same shapes, so nothing new compiles)."""
    cfg, params = convert.from_hf(_llama(YARN))
    tokens = np.random.default_rng(2).integers(0, 64, (2, 12))
    pos = np.stack([np.r_[0:4, 20:28]] * 2)
    a, _ = jaxllm.forward(params, cfg, tokens, positions=pos)
    b, _ = jaxllm.forward(params, cfg, tokens, positions=pos + 100)
    np.testing.assert_allclose(a, b, atol=2e-5)
    plain, _ = jaxllm.forward(params, cfg, tokens)
    assert np.abs(np.asarray(a) - np.asarray(plain)).max() > 1e-4  # the skip matters
    with pytest.raises(ValueError, match="strictly increasing"):
        jaxllm.forward(params, cfg, tokens, positions=pos[:, ::-1])
    with pytest.raises(ValueError, match="plain forward"):
        jaxllm.forward(params, cfg, tokens, jaxllm.init_cache(cfg, 2, 0, 16), positions=pos)


# ---- PoSE position sampling ----------------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from train.pose_sampling import draw, pose_sample  # noqa: E402


def np_pose(ids, Lc, rt1, rt2, rt):
    """A numpy port of the authors' train_preprocess_function_pose (docs/METHODS.md §6), for given
    draws: two chunks, chunk 1 at content and position 0, chunk 2 shifted by rt."""
    len_chunk = min(len(ids), Lc)
    lt1, rt1_ = 0, rt1
    lt2 = rt2 - (len_chunk - rt1)
    chunked = list(ids[lt1:rt1_]) + list(ids[lt2:rt2])
    pos = list(range(len_chunk))
    pos = pos[:rt1] + [p + rt for p in pos[rt1:]]
    return np.asarray(chunked), np.asarray(pos)


@settings(max_examples=40, deadline=None)
@given(n_ids=st.integers(2, 400), Lc=st.integers(2, 64), mult=st.integers(2, 16),
       seed=st.integers(0, 2**31))
def test_pose_sampler_matches_the_authors_and_its_properties(n_ids, Lc, mult, seed):
    Lt = Lc * mult
    ids = np.arange(1000, 1000 + n_ids)
    rt1, rt2, rt = draw(np.random.default_rng(seed), n_ids, Lc, Lt)
    got_ids, got_pos = pose_sample(ids, Lc, rt1, rt2, rt)
    want_ids, want_pos = np_pose(ids, Lc, rt1, rt2, rt)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_pos, want_pos)
    n = min(n_ids, Lc)
    assert len(got_ids) == len(got_pos) == n
    assert got_pos[0] == 0 and (np.diff(got_pos) > 0).all() and got_pos.max() < Lt
    assert rt1 <= math.ceil(Lc / 2)
    assert (np.diff(got_ids[:rt1]) == 1).all() and (np.diff(got_ids[rt1:]) == 1).all()


def test_pose_errors():
    with pytest.raises(ValueError, match="Lt=64 must exceed the training length Lc=64"):
        draw(np.random.default_rng(0), 100, 64, 64)
    with pytest.raises(ValueError, match="draws out of range"):
        pose_sample(np.arange(10), 8, 6, 9, 0)


def test_pose_and_rope_scaling_from_the_train_command_line():
    from train.config import recipe
    cfg = recipe("tiny", ["pose_target=1024", "model.rope_scaling=yarn:8:128"])
    assert cfg.pose_target == 1024
    assert cfg.model.rope_scaling == RopeScaling("yarn", 8.0, original_max_len=128)
    assert recipe("tiny", ["model.rope_scaling=none"]).model.rope_scaling is None
    with pytest.raises(ValueError, match="KIND:FACTOR"):
        recipe("tiny", ["model.rope_scaling=yarn:eight"])
    with pytest.raises(ValueError, match="yarn rope scaling needs original_max_len"):
        recipe("tiny", ["model.rope_scaling=yarn:8"])
    opt = ["model.pos_emb=learned", "model.family=opt", "model.max_seq_len=128"]
    with pytest.raises(ValueError, match="learned positions for 128 tokens"):
        recipe("tiny", opt + ["pose_target=1024"])
