"""SmoothQuant against independent references: numpy int32 products and eq. 2, the paper's
smoothing formula computed by hand, the float model (smoothing must not change it), and the
sink cache's own recompute reference for INT8 + StreamingLLM."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA, NEOX
from naive import rounded_weights

import jaxllm
from jaxllm import bits, quant, tree, weight_only
from jaxllm import smoothquant as sq
from pallas_kernels.reference import EXACT_F32_K

CC = sq.CalibConfig(n_seqs=8, seq_len=64, heldout_seqs=2)
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 64, 6000)
FALCON = dataclasses.replace(NEOX, family="falcon", shared_norm=True, attn_bias=False,
                             mlp_bias=False, tie_embeddings=True)
MPT = dataclasses.replace(NEOX, family="mpt", pos_emb="alibi", norm_bias=False, attn_bias=False,
                          mlp_bias=False, parallel_residual=False, tie_embeddings=True)


def with_outliers(params, cfg, channels=(3, 17), gain=60.0):
    """Make a few channels of every norm output huge while leaving the float function intact:
    the norm's gain (and bias) goes up by ``gain`` on those channels and the rows of every linear
    reading it go down by as much — the pattern LLM activations have (SmoothQuant Fig. 4)."""
    p = jax.tree.map(np.array, jax.device_get(params))
    f = np.ones(cfg.hidden_size, np.float32)
    f[list(channels)] = gain
    for norm, linears in sq.smooth_groups(cfg):
        n = tree.get(p, norm)
        n["scale"] = n["scale"] * f
        if "bias" in n:
            n["bias"] = n["bias"] * f
        for lin in linears:
            tree.get(p, lin)["kernel"] = tree.get(p, lin)["kernel"] / f[:, None]
    return jax.tree.map(jnp.asarray, p)


def test_library_outlier_injection_equals_the_hand_written_one():
    params = jaxllm.init_params(NEOX, jax.random.key(9))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 sq.add_outlier_channels(params, NEOX, (3, 17), 60.0), with_outliers(params, NEOX))


@pytest.mark.parametrize("cfg", [NEOX, LLAMA, FALCON, MPT], ids=["neox", "llama", "falcon", "mpt"])
def test_smoothing_alone_leaves_logits_unchanged(cfg):
    params = with_outliers(jaxllm.init_params(cfg, jax.random.key(1)), cfg)
    stats = sq.calibrate(params, cfg, IDS[:512].reshape(8, 64))
    down = cfg.mlp == "swiglu"
    groups = sq.smooth_groups(cfg, smooth_down=down)
    sm = sq.apply_smoothing(params, groups, sq.smoothing_factors(params, stats, groups, 0.8))
    toks = IDS[None, :48]
    np.testing.assert_allclose(jaxllm.forward(jax.tree.map(jnp.asarray, sm), cfg, toks)[0],
                               jaxllm.forward(params, cfg, toks)[0], atol=1e-5, rtol=0)


def test_smoothing_factor_is_the_papers_formula():
    cfg = LLAMA
    params = jaxllm.init_params(cfg, jax.random.key(2))
    stats = sq.calibrate(params, cfg, IDS[:512].reshape(8, 64))
    # by hand for one input channel: s_j = max|X_j|^a / max|W_j|^(1-a), W over q, k and v
    j, a = 5, 0.7
    lp = jax.device_get(params["layer_1"]["attn"])
    w_max = max(abs(float(v)) for n in "qkv" for v in lp[n]["kernel"][j])
    x_max = float(stats["layer_1/attn/q"][j])
    groups = sq.smooth_groups(cfg)
    s = sq.smoothing_factors(params, stats, groups, a)["layer_1/ln_attn"][j]
    assert s == pytest.approx(x_max ** a / w_max ** (1 - a), rel=1e-6)
    assert np.array_equal(stats["layer_1/attn/q"], stats["layer_1/attn/v"])  # same input


def test_calibration_maxima_match_a_numpy_forward():
    from naive import _norm, _np
    cfg = dataclasses.replace(LLAMA, num_layers=1)
    params = jaxllm.init_params(cfg, jax.random.key(3))
    toks = IDS[:256].reshape(4, 64)
    stats = sq.calibrate(params, cfg, toks)
    p = _np(params)
    x = p["embed"]["embedding"][toks]  # [4, 64, D]: the first norm reads the embeddings
    ref = np.abs(_norm(x, p["layer_0"]["ln_attn"], cfg)).reshape(-1, cfg.hidden_size).max(0)
    np.testing.assert_allclose(stats["layer_0/attn/q"], ref, rtol=1e-5)


@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (37, 64, 33), (128, 129, 17)])
def test_int8_matmul_is_exact_and_epilogue_is_eq2(m, k, n):
    rng = np.random.default_rng(m)
    xq = rng.integers(-127, 128, (m, k), dtype=np.int8)
    wq = rng.integers(-127, 128, (k, n), dtype=np.int8)
    ref = xq.astype(np.int64) @ wq.astype(np.int64)
    # the weight is stored K-major ([n, k]); a batch of rows, and a single (padded) row
    np.testing.assert_array_equal(np.asarray(quant.int8_matmul(xq, wq.T)), ref)
    np.testing.assert_array_equal(np.asarray(quant.int8_matmul(xq[None, :1], wq.T)), ref[None, :1])
    # qmatmul = diag(sx) (X̄ W̄) diag(sw) with X̄ = round(x / sx) per token, W̄ per channel
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(k, n)).astype(np.float32)
    sx = np.abs(x).max(1, keepdims=True) / 127
    sw = np.abs(w).max(0) / 127
    xb = np.clip(np.round(x / sx), -127, 127)
    wb = np.clip(np.round(w / sw), -127, 127)
    want = (xb.astype(np.int64) @ wb.astype(np.int64)) * sx * sw
    got = quant.qmatmul(jnp.asarray(x), quant.quantize_weight(jnp.asarray(w), True, "token"))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [EXACT_F32_K, EXACT_F32_K + 1])
def test_one_row_int8_product_is_exact_at_the_float32_bound(k):
    """One row on CPU is summed in float32, exact while K <= 1024: the extreme row (every product
    128^2, the sum 2^24 at K = 1024), a mixed one and one a unit off; K = 1025 goes the int32
    way, which the last row checks: there its sum is 2^24 + 1, which float32 cannot hold.
    Against numpy's int64 product."""
    x = np.full((1, k), -128, np.int8)
    x[0, -1] = 1
    w = np.full((5, k), -128, np.int8)
    w[1] = 127
    w[2, ::2] = 127
    w[3, 0] = -127
    w[4, -1] = 1
    want = x.astype(np.int64) @ w.T.astype(np.int64)
    np.testing.assert_array_equal(np.asarray(quant.int8_matmul(x, w)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.int8_matmul)(x, w)), want)
    if k > EXACT_F32_K:
        assert want[0, 4] == 2 ** 24 + 1


@pytest.mark.parametrize("lead,n_in,n_out,per_channel", [((12,), 64, 2500, True),
                                                          ((2, 6), 64, 2048, False),
                                                          ((1, 1), 64, 2500, True),
                                                          ((1,), 4100, 40, True),
                                                          ((40,), 64, 300, False),
                                                          ((80,), 64, 2500, False),
                                                          ((5,), 96, 40, True)])
def test_weight_only_matmul_is_x_times_dequantized_w(lead, n_in, n_out, per_channel):
    """W8 (act 'none') = x @ (q·s)ᵀ in float64, whatever the form: on CPU one row of 64 inputs
    is a vector-matrix product, one row of 4,100 a row reduction over two copies of it, 5 or 12
    rows one row reduction, 40 rows two (32 + 8), 80 rows (prefill) one plain product."""
    rng = np.random.default_rng(n_out)
    x = rng.normal(size=(*lead, n_in)).astype(np.float32)
    w = rng.normal(size=(n_in, n_out)).astype(np.float32)
    k = quant.quantize_weight(jnp.asarray(w), per_channel, "none")
    deq = np.asarray(k.q, np.float64) * (np.asarray(k.scale, np.float64)[:, None]
                                         if per_channel else float(k.scale))
    want = x.astype(np.float64) @ deq.T
    got = quant.qmatmul(jnp.asarray(x), k)
    assert got.shape == (*lead, n_out)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # bfloat16 compute: the input and the result rounded to bfloat16, nothing else
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    got16 = quant.qmatmul(jnp.asarray(x), k, jnp.bfloat16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got16, np.float64), x16 @ deq.T, rtol=2 ** -8,
                               atol=1e-2)


@pytest.mark.parametrize("lead,n_out", [((8,), 2501), ((2, 3), 64), ((40,), 700)])
def test_float16_weights_of_several_rows_in_widened_groups(lead, n_out, monkeypatch):
    """float16 weights and several rows take blocks of output rows widened one at a time
    (bits.in_widened_groups): x @ wᵀ in float64, also with blocks that do not divide the
    outputs (the last block overlaps the one before) and with blocks of one row."""
    rng = np.random.default_rng(n_out)
    x = rng.normal(size=(*lead, 48)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(n_out, 48)), jnp.float16)
    want = x.astype(np.float64) @ np.asarray(w, np.float64).T
    for budget in (bits.WIDEN_BYTES, 48 * 4 * 7, 1):  # one block; blocks of 7 rows; of one
        monkeypatch.setattr(bits, "WIDEN_BYTES", budget)
        got = weight_only.weight_only_matmul(jnp.asarray(x), w, jnp.ones(()))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg,dtype,B", [(NEOX, "bfloat16", 2), (LLAMA, "float16", 1),
                                         (FALCON, "bfloat16", 1), (LLAMA, "float32", 2)],
                         ids=["neox", "llama", "falcon", "llama-float32"])
def test_decode_weights_equal_the_model_with_rounded_weights(cfg, dtype, B):
    """Weights stored [out, in] (a 12-token chunk, then one-token steps into a sink cache: on
    CPU, row reductions for several rows and a vector-matrix product for one) give the logits of
    the float model whose weights were rounded to the same dtype (float32: the model itself), to
    float32 rounding; 2-byte weights take half the bytes."""
    params = jax.tree.map(lambda x: x * 4 if x.ndim == 2 else x,  # O(1) logits
                          jaxllm.init_params(cfg, jax.random.key(3)))
    stored, ref = quant.decode_weights(params, dtype), rounded_weights(params, dtype)
    k = stored["layer_0"]["mlp"]["down"]["kernel"]
    assert (k.q.dtype, k.q.shape) == (jnp.dtype(dtype), params["layer_0"]["mlp"]["down"]["kernel"].T.shape)
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
    assert nbytes(stored) / nbytes(params) < (0.55 if dtype != "float32" else 1.01)
    toks = IDS[3000:3000 + 14 * B].reshape(B, 14)
    got, want = [], []
    for p, out in ((stored, got), (ref, want)):
        cache = jaxllm.init_cache(cfg, B, sinks=2, window=6)
        logits, cache = jaxllm.forward(p, cfg, toks[:, :12], cache)
        out.append(logits)
        for t in range(12, 14):
            logits, cache = jaxllm.forward(p, cfg, toks[:, t:t + 1], cache)
            out.append(logits)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), rtol=0)


def test_half_weights_save_load_and_errors(tmp_path):
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    half = quant.half_weights(params)
    jaxllm.save_model(str(tmp_path / "m"), LLAMA, half, format="safetensors")
    _, half2, _ = jaxllm.load_model(str(tmp_path / "m"))
    toks = IDS[None, :9]
    np.testing.assert_array_equal(jaxllm.forward(half2, LLAMA, toks)[0],
                                  jaxllm.forward(half, LLAMA, toks)[0])
    assert half2["embed"]["embedding"].q.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="bfloat16 or float16 weights, got 'int8'"):
        quant.half_weights(params, "int8")
    with pytest.raises(ValueError, match="bfloat16 or float16 weights, got 'float32'"):
        quant.half_weights(params, "float32")  # 2 bytes, as its name says: decode_weights
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 weights, got 'int8'"):
        quant.decode_weights(params, "int8")
    with pytest.raises(ValueError, match=r"quantized \(or in a decode layout\) already"):
        quant.half_weights(half)
    k = half["layer_0"]["attn"]["q"]["kernel"].replace(act="token")
    with pytest.raises(ValueError, match="bfloat16 weight is weight-only"):
        quant.qmatmul(jnp.ones((1, 32)), k)


@pytest.fixture(scope="module")
def outlier_model():
    # weights 5x the init scale so activations and logits are O(1), then outlier channels
    base = jax.tree.map(lambda x: x * 5 if x.ndim == 2 else x,
                        jaxllm.init_params(LLAMA, jax.random.key(4)))
    params = with_outliers(base, LLAMA)
    toks = jnp.asarray(IDS[None, 1000:1096])
    return params, toks, jaxllm.forward(params, LLAMA, toks)[0]


@pytest.mark.parametrize("scheme,per_channel", [("o1", None), ("o2", None), ("o3", None),
                                                ("w8", None), ("o1", True)])
def test_real_and_fake_quant_agree(scheme, per_channel, outlier_model):
    params, toks, _ = outlier_model
    real = sq.quantize(params, LLAMA, IDS, scheme, 0.8, calib=CC, per_channel=per_channel)
    fake = sq.quantize(params, LLAMA, IDS, scheme, 0.8, calib=CC, real=False,
                       per_channel=per_channel)
    want = (LLAMA.hidden_size,) if (per_channel or scheme == "w8") else ()
    assert real["layer_0"]["attn"]["q"]["kernel"].scale.shape == want
    assert isinstance(real["layer_0"]["attn"]["q"]["kernel"], quant.QKernel)
    assert real["layer_0"]["attn"]["q"]["kernel"].q.dtype == jnp.int8
    np.testing.assert_allclose(jaxllm.forward(real, LLAMA, toks)[0],
                               jaxllm.forward(fake, LLAMA, toks)[0], atol=1e-5, rtol=0)


def test_embedding_and_head_can_stay_float(outlier_model):
    """The SmoothQuant authors keep the embedding and the head in float: the switches leave
    exactly the original tensors there (neither is smoothed) and the body quantized as before."""
    params, toks, ref = outlier_model
    base = sq.quantize(params, LLAMA, IDS, "o1", 0.8, calib=CC)
    kept, info = sq.quantize(params, LLAMA, IDS, "o1", 0.8, calib=CC, quantize_embedding=False,
                             quantize_head=False, return_info=True)
    assert not info["quantize_embedding"] and not info["quantize_head"]
    assert isinstance(base["embed"]["embedding"], quant.QKernel)
    assert isinstance(base["lm_head"]["kernel"], quant.QKernel)
    np.testing.assert_array_equal(kept["embed"]["embedding"], params["embed"]["embedding"])
    np.testing.assert_array_equal(kept["lm_head"]["kernel"], params["lm_head"]["kernel"])
    for a, b in zip(jax.tree.leaves(base["layer_1"]), jax.tree.leaves(kept["layer_1"])):
        np.testing.assert_array_equal(a, b)
    err = lambda q: float(jnp.sqrt(jnp.mean((jaxllm.forward(q, LLAMA, toks)[0] - ref) ** 2)))  # noqa: E731
    assert err(kept) <= err(base) * 1.05  # fewer quantized tensors: no worse
    tied = dataclasses.replace(LLAMA, tie_embeddings=True)
    with pytest.raises(ValueError, match="ties its output head"):
        sq.quantize(jaxllm.init_params(tied, jax.random.key(0)), tied, IDS, "o1", calib=CC,
                    quantize_head=False)


def test_smoothing_rescues_quantization_of_outlier_channels(outlier_model):
    """The paper's claim in miniature: per-channel outliers wreck naive W8A8, smoothing fixes it."""
    params, toks, ref = outlier_model
    err = {}
    for name, kw in [("naive", dict(smooth=False)), ("o1", dict(alpha=0.8)),
                     ("o3", dict(alpha=0.8))]:
        q = sq.quantize(params, LLAMA, IDS, "o3" if name == "o3" else "o1", calib=CC, **kw)
        diff = jaxllm.forward(q, LLAMA, toks)[0] - ref
        err[name] = float(jnp.sqrt(jnp.mean(diff ** 2)) / jnp.std(ref))  # relative RMS error
    # measured: naive 0.29, o1 0.02, o3 0.03 (smoothing undoes the injected outliers exactly)
    assert err["naive"] > 0.2 and err["o1"] < 0.05 and err["o3"] < 0.05, err


def test_auto_alpha_picks_the_lowest_heldout_loss(outlier_model):
    params, _, _ = outlier_model
    q, info = sq.quantize(params, LLAMA, IDS, "o1", "auto", calib=CC, return_info=True)
    losses = {float(k): v for k, v in info["losses"].items()}
    assert set(losses) == set(sq.AUTO_GRID)
    assert info["alpha"] == min(losses, key=losses.get)


def test_int8_with_streaming_cache_in_one_jit():
    """A 1-layer o1 model streamed through a 2+5 sink cache equals the same quantized model run
    on [sinks + last window] (per-token activation scales make chunking irrelevant), and the jit
    generate loop equals its Python twin."""
    cfg = dataclasses.replace(LLAMA, num_layers=1)
    q = sq.quantize(jaxllm.init_params(cfg, jax.random.key(5)), cfg, IDS, "o1", 0.8, calib=CC)
    S, W, N = 2, 5, 24
    toks = IDS[None, 2000:2000 + N]
    ref = []
    for t in range(N):
        kept = list(range(min(S, t + 1))) + list(range(max(S, t - W + 1), t + 1))
        ref.append(jaxllm.forward(q, cfg, toks[:, kept])[0][:, -1])
    got, _ = jaxllm.forward(q, cfg, toks, jaxllm.init_cache(cfg, 1, sinks=S, window=W))
    np.testing.assert_allclose(got, jnp.stack(ref, 1), atol=1e-5, rtol=0)
    sc = jaxllm.SamplingConfig(max_new_tokens=20)
    a = jaxllm.generate(q, cfg, toks[:, :6], jaxllm.init_cache(cfg, 1, sinks=S, window=W), sc)
    b = jaxllm.generate_python(q, cfg, toks[:, :6], jaxllm.init_cache(cfg, 1, sinks=S, window=W),
                               sc)
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_int8_params_save_and_load(fmt, tmp_path, outlier_model):
    params, toks, _ = outlier_model
    q = sq.quantize(params, LLAMA, IDS, "o3", 0.8, calib=CC)
    jaxllm.save_model(str(tmp_path / "m"), LLAMA, q, format=fmt)
    _, q2, _ = jaxllm.load_model(str(tmp_path / "m"))
    np.testing.assert_array_equal(jaxllm.forward(q2, LLAMA, toks)[0],
                                  jaxllm.forward(q, LLAMA, toks)[0])
    k = q2["layer_1"]["mlp"]["down"]["kernel"]
    assert (k.q.dtype, k.act, k.real, k.act_scale.shape) == (jnp.int8, "static", True, ())


def test_weights_shrink_to_a_quarter():
    cfg = jaxllm.ModelConfig.gpt_neox(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4)
    params = jaxllm.init_params(cfg, jax.random.key(0))
    q = sq.quantize(params, cfg, np.arange(3000) % 512, "o1", calib=CC)
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
    assert nbytes(q) / nbytes(params) < 0.27


def test_errors():
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    with pytest.raises(ValueError, match="calibration text too short: 50 tokens"):
        sq.quantize(params, LLAMA, IDS[:50], "o1", calib=CC)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        sq.quantize(params, LLAMA, IDS, "o1", 1.5, calib=CC)
    with pytest.raises(ValueError, match="unknown scheme 'o4'; choose one of o1, o2, o3, w8"):
        sq.quantize(params, LLAMA, IDS, "o4", calib=CC)
    q = sq.quantize(params, LLAMA, IDS, "o1", calib=CC)
    with pytest.raises(ValueError, match="already quantized"):
        sq.quantize(q, LLAMA, IDS, "o1", calib=CC)
    post = dataclasses.replace(NEOX, family="opt", pre_norm=False, parallel_residual=False)
    with pytest.raises(ValueError, match="post-LN"):
        sq.quantize(jaxllm.init_params(post, jax.random.key(0)), post, IDS, "o1", calib=CC)


def test_paper_alpha_only_where_the_paper_measured():
    """The family's alpha for models in the paper's size range (6.7B+), none for a small one
    (SmolLM2-135M: 0.85, the Llama value, made it worse than naive W8A8; docs/RESULTS.md)."""
    assert sq.paper_alpha(jaxllm.PRESETS["llama2-7b"]) == 0.85
    assert sq.paper_alpha(LLAMA) is None and sq.paper_alpha(jaxllm.PRESETS["pythia-160m"]) is None


def test_cli_quantize_then_every_command_takes_the_result(tmp_path, capsys):
    from jaxllm.cli import main
    out = str(tmp_path / "q")
    assert main(["quantize", "--model", "random:pythia-tiny", "--scheme", "o3", "--n-seqs", "4",
                 "--seq-len", "64", "--out", out, "--quiet", "--json", out + ".json"]) == 0
    err = capsys.readouterr().err
    assert "alpha: auto (the paper gives no value" in err
    assert json.loads(open(out + ".json").read())["losses"]  # the search ran
    # What it calibrated on is said, and recorded with the model.
    import hashlib
    from jaxllm.corpus import calibration_corpus
    assert "calibrated on the embedded mixed text" in err and "--calib-text FILE" in err
    made = json.load(open(os.path.join(out, "config.json")))["provenance"]
    assert made["scheme"] == "o3" and made["from"] == "random:pythia-tiny"
    assert made["calibration"]["sha256"] == hashlib.sha256(calibration_corpus().encode()).hexdigest()
    assert (made["calibration"]["seqs"], made["calibration"]["seq_len"]) == (4, 64)
    assert main(["ppl", "--model", out, "--max-tokens", "600", "--cache", "64", "--quiet"]) == 0
    assert main(["generate", "--model", out, "--prompt", "def", "--max-new-tokens", "8",
                 "--cache", "32"]) == 0
    assert main(["quantize", "--model", out, "--out", str(tmp_path / "qq"), "--quiet"]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_int8_attention_bmms_follow_eq2():
    """QKᵀ and PV with per-row scales along the products' outer dims, against numpy int64."""
    rng = np.random.default_rng(7)
    q = rng.normal(size=(1, 3, 2, 2, 8)).astype(np.float32)  # [b, t, kvh, g, h]
    k = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)  # [b, s, kvh, h]
    sq_, sk = np.abs(q).max(-1, keepdims=True) / 127, np.abs(k).max(-1, keepdims=True) / 127
    qb, kb = np.round(q / sq_).astype(np.int64), np.round(k / sk).astype(np.int64)
    want = np.einsum("btkgh,bskh->bkgts", qb, kb) * np.einsum(
        "btkg->bkgt", sq_[..., 0])[..., None] * np.einsum("bsk->bks", sk[..., 0])[:, :, None,
                                                                              None, :]
    kh = k.transpose(0, 2, 1, 3)  # the model passes keys head-major [b, kvh, s, h]
    np.testing.assert_allclose(quant.qk_scores(q, kh, True), want, rtol=1e-6)
    p = rng.uniform(size=(1, 2, 2, 3, 5)).astype(np.float32)  # [b, kvh, g, t, s]
    v = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
    sp, sv = p.max(-1, keepdims=True) / 127, np.abs(v).max(1, keepdims=True) / 127
    pb, vb = np.round(p / sp).astype(np.int64), np.round(v / sv).astype(np.int64)
    want = np.einsum("bkgts,bskh->btkgh", pb, vb) * np.einsum(
        "bkgt->btkg", sp[..., 0])[..., None] * sv[:, 0, :, None, :]
    np.testing.assert_allclose(quant.pv(p, v.transpose(0, 2, 1, 3), jnp.asarray(sp), True), want,
                               rtol=1e-6)


def test_int8_attention_option(outlier_model, tmp_path):
    params, toks, ref = outlier_model
    real = sq.quantize(params, LLAMA, IDS, "o1", 0.8, calib=CC, int8_attention=True)
    fake = sq.quantize(params, LLAMA, IDS, "o1", 0.8, calib=CC, int8_attention=True, real=False)
    got = jaxllm.forward(real, LLAMA, toks)[0]
    np.testing.assert_allclose(got, jaxllm.forward(fake, LLAMA, toks)[0], atol=1e-5, rtol=0)
    assert float(jnp.sqrt(jnp.mean((got - ref) ** 2)) / jnp.std(ref)) < 0.06
    jaxllm.save_model(str(tmp_path / "m"), LLAMA, real)
    _, back, _ = jaxllm.load_model(str(tmp_path / "m"))
    assert isinstance(back["layer_0"]["attn"]["int8_attention"], quant.QAttention)
    np.testing.assert_array_equal(jaxllm.forward(back, LLAMA, toks)[0], got)
