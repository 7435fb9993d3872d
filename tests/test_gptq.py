"""GPTQ and RTN (jaxllm.gptq) into the low-bit layout (jaxllm.lowbit), against references
written here: the paper's Algorithm 1 unblocked in numpy float64, numpy's unpacking of the
codes, and the layer-wise objective; then whole models through the layout (save, load, the CLI)
and XLA's accounting that a decode loop holds no float copy of 4-bit weights."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import gptq, lowbit


def np_grid(w, bits, sym):
    """The authors' quantizer (per row): xmin/xmax including 0, zero = round(-xmin/scale)."""
    maxq = 2 ** bits - 1
    xmin, xmax = np.minimum(w.min(1), 0), np.maximum(w.max(1), 0)
    if sym:
        xmax = np.maximum(-xmin, xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    both = (xmin == 0) & (xmax == 0)
    xmin[both], xmax[both] = -1, 1
    scale = (xmax - xmin) / maxq
    zero = np.full_like(scale, (maxq + 1) / 2) if sym else np.round(-xmin / scale)
    return scale, zero


def _np_dead_columns(W, H):
    """Copies of W and H with dead inputs (H_jj = 0) given H_jj = 1 and zero weight."""
    W, H = W.copy(), H.copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    return W, H


def _np_upper_inverse(H, damp):
    """The upper Cholesky factor U of the dampened H's inverse (H⁻¹ = Uᵀ U)."""
    H = H + damp * np.mean(np.diag(H)) * np.eye(len(H))
    return np.linalg.cholesky(np.linalg.inv(H)).T


def np_gptq(W, H, bits, G, sym, act_order, damp=0.01):
    """Algorithm 1 of the paper, one column at a time with the full update after each (no lazy
    batches), float64; groups fitted at their first column on the updated weights, or with
    act-order fixed up front per original group."""
    W, H = _np_dead_columns(W, H)
    out, n = W.shape
    maxq = 2 ** bits - 1
    fixed = [np_grid(W[:, g:g + G], bits, sym) for g in range(0, n, G)]
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(n)
    W, H = W[:, perm], H[perm][:, perm]
    U = _np_upper_inverse(H, damp)
    codes = np.zeros((out, n))
    for j in range(n):
        if act_order or G == n:
            s, z = fixed[perm[j] // G]
        elif j % G == 0:
            s, z = np_grid(W[:, j:j + G], bits, sym)
        q = np.clip(np.round(W[:, j] / s) + z, 0, maxq)
        codes[:, j] = q
        err = (W[:, j] - s * (q - z)) / U[j, j]
        W[:, j + 1:] -= np.outer(err, U[j, j + 1:])
    return codes[:, np.argsort(perm)]


def _layer(seed=0, out=16, n=96):
    """Correlated inputs (condition number of H in the 10^5s) and a weight."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((512, n)) @ (rng.standard_normal((n, n)) * np.linspace(0.05, 2, n))
    H = 2 * X.T @ X / 512
    H[5, :], H[:, 5] = 0, 0  # a dead input column
    return rng.standard_normal((out, n)), H, X


@pytest.mark.parametrize("bits,G,sym,act_order", [
    (4, 32, False, False), (3, 40, False, False),  # 40 into 96: a ragged last group
    (4, 32, True, True), (2, 96, False, False)])  # act-order with static groups; per channel
def test_gptq_is_algorithm_1(bits, G, sym, act_order):
    """Blocked (lazy batches of whole groups), in float64: the same codes as the unblocked
    algorithm, while round-to-nearest's differ on many entries."""
    W, H, _ = _layer()
    assert np.linalg.cond(H + np.eye(len(H)) * (np.diag(H) == 0)) >= 100
    cfg = gptq.GPTQConfig(bits=bits, group=0 if G == 96 else G, sym=sym, act_order=act_order,
                          block=32 if G <= 32 else 40)
    want = np_gptq(W, H, bits, G, sym, act_order)
    with jax.enable_x64():
        codes = np.asarray(gptq.gptq_layer(jnp.asarray(W), jnp.asarray(H), cfg)[0])
    np.testing.assert_array_equal(codes, want)
    rtn = np.asarray(gptq.rtn_layer(jnp.asarray(W, jnp.float32), cfg)[0])
    assert (rtn != want).mean() > 0.05


def np_fasterquant(W, H, bits, G, B, damp=0.01):
    """The authors' GPTQ.fasterquant (act-order off, asymmetric), in numpy float64: lazy
    blocks of B columns, and a group's grid fitted at its first column on the full weight W,
    which takes the updates of earlier blocks only (W1, the block's working copy, takes the
    updates inside the block)."""
    W, H = _np_dead_columns(W, H)
    out, n = W.shape
    maxq = 2 ** bits - 1
    Hinv = _np_upper_inverse(H, damp)
    codes = np.zeros((out, n))
    for i1 in range(0, n, B):
        i2 = min(i1 + B, n)
        W1, Err1 = W[:, i1:i2].copy(), np.zeros((out, i2 - i1))
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if (i1 + i) % G == 0:
                s, z = np_grid(W[:, i1 + i:i1 + i + G], bits, False)
            w, d = W1[:, i], Hinv1[i, i]
            q = np.clip(np.round(w / s) + z, 0, maxq)
            codes[:, i1 + i] = q
            err = (w - s * (q - z)) / d
            W1[:, i:] -= np.outer(err, Hinv1[i, i:])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return codes


@pytest.mark.parametrize("G,B", [(32, 96), (16, 48)])
def test_groups_inside_a_lazy_block_are_fitted_as_the_authors_do(G, B):
    """Groups smaller than the lazy block: each group's grid from the columns as they stood
    when the block began, as the authors' fasterquant fits it (fitted on the columns updated
    inside the block, 19% of the codes differed from theirs)."""
    W, H, _ = _layer()
    with jax.enable_x64():
        codes = np.asarray(gptq.gptq_layer(jnp.asarray(W), jnp.asarray(H),
                                           gptq.GPTQConfig(bits=3, group=G, block=B))[0])
    np.testing.assert_array_equal(codes, np_fasterquant(W, H, 3, G, B))


@pytest.mark.parametrize("group", [0, 32, 40])
def test_gptq_with_a_scaled_identity_hessian_is_rtn(group):
    W, _, _ = _layer(1)
    cfg = gptq.GPTQConfig(bits=3, group=group, block=40 if group == 40 else 32)
    with jax.enable_x64():
        got = gptq.gptq_layer(jnp.asarray(W), 3.0 * jnp.eye(96), cfg)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gptq.rtn_layer(
        jnp.asarray(W, jnp.float32), cfg)[0]))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_low_bit_product_is_numpy_unpack_dequantize_matmul(bits, monkeypatch):
    """Codes packed by the layout, unpacked here bit by bit (word w, field j = column w·per+j),
    times scale plus offset per group (a ragged last group), then the product (which goes in
    chunks of whole words and groups, and a shorter last one: 700 = 2 x 320 + 60 at 3 bits)."""
    rng = np.random.default_rng(bits)
    out, n, G = 5, 700, 32
    codes = rng.integers(0, 2 ** bits, (out, n))
    scale, offset = rng.random((out, 22)) * 0.1, rng.standard_normal((out, 22))
    node = lowbit.encode(codes, scale, offset, bits, G)
    words = np.asarray(node.codes).astype(np.int64)
    if bits == 8:
        got_codes = words
    else:
        per = 32 // bits
        got_codes = np.stack([(words >> (bits * j)) & (2 ** bits - 1) for j in range(per)],
                             -1).reshape(out, -1)[:, :n]
    np.testing.assert_array_equal(got_codes, codes)
    w = codes * np.repeat(scale, G, 1)[:, :n] + np.repeat(offset, G, 1)[:, :n]
    x = rng.standard_normal((4, n))
    want = x @ np.asarray(w, np.float32).T
    got = lowbit.matmul(jnp.asarray(x, jnp.float32), node)  # small: dequantized whole
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(lowbit, "WHOLE_ELEMENTS", 0)  # as a large weight goes: in chunks
    assert lowbit.chunk_columns(node) < n
    got = lowbit.matmul(jnp.asarray(x, jnp.float32), node)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_quantized_model_saves_loads_and_refuses_requantizing(tmp_path):
    from conftest import LLAMA
    LLAMA = dataclasses.replace(LLAMA, num_layers=1)
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    toks = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, LLAMA.vocab_size))
    q, info = gptq.quantize_model(params, LLAMA, toks, gptq.GPTQConfig(bits=4, group=16))
    assert set(info["layers"]) == {f"layer_{i}/{n}" for i in range(LLAMA.num_layers)
                                   for n in ("attn/q", "attn/k", "attn/v", "attn/o",
                                             "mlp/up", "mlp/gate", "mlp/down")}
    assert info["linear_bytes"] < info["float_linear_bytes"] / 3  # 4 bits + 2 floats per 16
    want = jaxllm.forward(q, LLAMA, toks[:1])[0]
    jaxllm.save_model(str(tmp_path / "m"), LLAMA, q)  # (orbax stores the same plain tree)
    cfg, back, _ = jaxllm.load_model(str(tmp_path / "m"))
    np.testing.assert_array_equal(np.asarray(jaxllm.forward(back, cfg, toks[:1])[0]),
                                  np.asarray(want))
    with pytest.raises(ValueError, match="already quantized"):
        gptq.quantize_model(q, LLAMA, toks, gptq.GPTQConfig())


def test_true_sequential_stages_follow_the_authors_order():
    names = ["attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down",
             "mlp/extra"]
    assert gptq._stages(names, True) == [["attn/q", "attn/k", "attn/v"], ["attn/o"],
                                         ["mlp/up", "mlp/gate"], ["mlp/down"], ["mlp/extra"]]
    assert gptq._stages(names, False) == [names]


def test_decode_loop_holds_no_float_copy_of_4_bit_weights():
    """generate's compiled loop at Llama-2-7B shapes (4 layers) with abstract 4-bit weights:
    XLA's temporaries stay under 1 GiB, where a float32 copy of the 4 layers' linears alone
    would be 3.2 GB (the loop's barrier keeps each layer's dequantization inside the step);
    lowered for CUDA, the loop's products are the Pallas kernel's."""
    from jaxllm.generate import SamplingConfig, _generate_jit, loop_args
    cfg = dataclasses.replace(jaxllm.PRESETS["llama2-7b"], num_layers=4)
    abstract = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))

    def node(kernel):  # a [in, out] kernel as a 4-bit group-128 node, abstractly
        n, o = kernel.shape
        S = jax.ShapeDtypeStruct
        return lowbit.QLowBit(S((o, n // 8), jnp.uint32), S((o, n // 128), jnp.float32),
                              S((o, n // 128), jnp.float32), bits=4, group=128, in_features=n)
    from jaxllm import tree
    flat = tree.flatten(abstract)
    for k, v in flat.items():
        if k.startswith("layer_") and k.endswith("/kernel"):
            flat[k] = node(v)
    params = tree.unflatten(flat)
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, 1, sinks=4, window=252))
    S = jax.ShapeDtypeStruct
    args = loop_args(params, cfg, SamplingConfig(max_new_tokens=8), S((1, 8), jnp.int32),
                     S((1,), jnp.int32), cache, jax.random.key(0))
    lowered = _generate_jit.lower(*args)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp < 1 << 30, temp / 2 ** 30
    # Lowered for a GPU, the same loop multiplies by the Pallas kernel that reads the codes.
    text = _generate_jit.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("args,msg", [
    (["--scheme", "gptq", "--alpha", "0.5"], "--alpha applies to SmoothQuant"),
    (["--scheme", "o1", "--bits", "4"], "--bits applies to gptq/rtn, not to --scheme o1"),
    (["--scheme", "rtn", "--act-order"], "--act-order applies to --scheme gptq"),
    (["--scheme", "rtn", "--bits", "5"], "--bits 5 is not supported"),
])
def test_cli_refuses_the_other_kinds_flags_in_one_line(args, msg, tmp_path, capsys):
    from jaxllm.cli import main
    assert main(["quantize", "--model", "embedded", "--out", str(tmp_path / "q"), "--quiet"]
                + args) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err and not (tmp_path / "q").exists()


def test_cli_rtn_writes_a_model_every_command_takes(tmp_path, capsys):
    """RTN 4-bit (no calibration) of the embedded model: its linears at under a fifth of their
    float32 bytes (the JSON says so), and ppl runs on the result."""
    import json
    from jaxllm.cli import main
    out, js = str(tmp_path / "q"), str(tmp_path / "q.json")
    assert main(["quantize", "--model", "embedded", "--scheme", "rtn", "--group", "64", "--out",
                 out, "--quiet", "--json", js]) == 0
    info = json.load(open(js))
    assert info["linear_bytes"] < info["float_linear_bytes"] / 5
    assert main(["ppl", "--model", out, "--max-tokens", "64", "--cache", "32", "--quiet"]) == 0
    assert "ppl" in capsys.readouterr().out
    # Its low-bit weights have no float decode layout: one line (a TypeError traceback before).
    assert main(["ppl", "--model", out, "--weights", "bfloat16", "--max-tokens", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--weights bfloat16: these weights are quantized" in err and "\n" not in err


def test_the_default_calibration_text_mixes_prose_and_code_and_holds_out_chapters():
    """quantize's default calibration (jaxllm.corpus.calibration_corpus): prose and Python's
    documentation in about equal parts, alternating in blocks much shorter than the text, so
    random windows see both; the novel's held-out chapters never in it."""
    from jaxllm.corpus import builtin_corpus, calibration_corpus, prose
    text, story, docs = calibration_corpus(), prose(), builtin_corpus()
    assert prose(held_out=True).startswith("CHAPTER X.") and prose(held_out=True) not in text
    assert "Gutenberg" not in story + prose(held_out=True)  # the plain public-domain text
    assert len(text) == 2 * len(story)
    # Which kind each 4 KiB of the mix comes from: both, many times over.
    kinds = ["prose" if text[i:i + 200] in story else "docs" if text[i:i + 200] in docs else "?"
             for i in range(0, len(text) - 200, 4096)]
    assert kinds.count("prose") > 20 and kinds.count("docs") > 20
    switches = sum(a != b for a, b in zip(kinds, kinds[1:]))
    assert switches >= 10, kinds
