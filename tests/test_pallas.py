"""Pallas INT8 kernels in interpret mode (Triton-style kernel with Pallas' generic interpreter,
Mosaic TPU kernel with the TPU interpreter) against numpy int64 and the jnp references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxllm.quant import absmax_scale, quantize
from pallas_kernels.matmul import Blocks

# Small blocks so odd shapes cross several blocks in every dimension, and the interpreter is fast.
SMALL = {"triton": Blocks(16, 32, 64), "tpu": Blocks(32, 128, 128)}
BACKENDS = ["triton", "tpu"]
K, N = 200, 72  # multiples of no block


def _ints(rng, shape):
    return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("M", [1, 7, 37, 128, 1000])
def test_int8_product_is_bit_exact(backend, M):
    rng = np.random.default_rng(M)
    x, w = _ints(rng, (M, K)), _ints(rng, (N, K))
    got = pk.w8a8_matmul(x, w, 1.0, 1.0, out_dtype=jnp.int32, backend=backend, interpret=True,
                         blocks=SMALL[backend])
    want = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.asarray(x, np.int64) @ np.asarray(w, np.int64).T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_token,per_channel,bias,out", [
    (True, True, True, "float32"), (False, True, False, "float32"),
    (True, False, True, "bfloat16"), (False, False, False, "bfloat16")])
def test_epilogue_matches_reference(backend, per_token, per_channel, bias, out):
    rng = np.random.default_rng(0)
    M = 37
    x, w = _ints(rng, (M, K)), _ints(rng, (N, K))
    sx = jnp.asarray(rng.random(M) + 0.1 if per_token else 0.37, jnp.float32)
    sw = jnp.asarray(rng.random(N) + 0.1 if per_channel else 0.02, jnp.float32)
    b = jnp.asarray(rng.normal(size=N), jnp.float32) if bias else None
    got = pk.w8a8_matmul(x, w, sx, sw, b, out_dtype=jnp.dtype(out), backend=backend,
                         interpret=True, blocks=SMALL[backend])
    acc = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    want = acc * np.broadcast_to(np.asarray(sx, np.float64), (M,))[:, None] * np.broadcast_to(
        np.asarray(sw, np.float64), (N,))[None] + (0.0 if b is None else np.asarray(b)[None])
    assert got.dtype == jnp.dtype(out) and got.shape == (M, N)
    rtol = 1e-6 if out == "float32" else 8e-3  # float32 rounding / bfloat16's 8 bits
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol,
                               atol=rtol * np.abs(want).max())
    ref = pk.w8a8_matmul(x, w, sx, sw, b, out_dtype=jnp.dtype(out), backend="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_blocks_pad_any_shape(backend):
    rng = np.random.default_rng(1)
    for M in (1, 130):
        x, w = _ints(rng, (M, 300)), _ints(rng, (100, 300))
        got = pk.w8a8_matmul(x, w, 1.0, 1.0, out_dtype=jnp.int32, backend=backend,
                             interpret=True)
        np.testing.assert_array_equal(got, np.asarray(x, np.int64) @ np.asarray(w, np.int64).T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", [None, "layernorm", "rmsnorm"])
def test_fused_norm_quantize(backend, norm):
    rng = np.random.default_rng(2)
    M, D = 37, 200
    x = jnp.asarray(rng.normal(size=(M, D)) * 3, jnp.float32)
    x = x.at[5].set(0.0)  # an all-zero row: scale 1, not a division by zero
    g = jnp.asarray(rng.random(D) + 0.5, jnp.float32)
    b = jnp.asarray(rng.normal(size=D), jnp.float32) if norm == "layernorm" else None
    q, s = pk.quantize_per_token(x, g if norm else None, b, norm=norm, backend=backend,
                                 interpret=True)
    qr, sr = pk.reference.quantize_per_token(x, norm, g, b)
    assert q.dtype == jnp.int8 and q.shape == (M, D) and s.shape == (M,)
    np.testing.assert_allclose(s, sr, rtol=1e-6)
    diff = np.abs(np.asarray(q, np.int32) - np.asarray(qr, np.int32))
    if norm is None:
        np.testing.assert_array_equal(q, qr)
    else:  # the norm's float rounding may move a value across a .5 boundary
        assert diff.max() <= 1 and (diff == 0).mean() > 0.999
    if norm is None:  # the reference agrees with the library's quantizer (jaxllm.quant)
        np.testing.assert_array_equal(qr, quantize(x, absmax_scale(x, -1, True)))
        assert float(s[5]) == 1.0 and not np.asarray(q[5]).any()


@pytest.mark.parametrize("eq,sa,sb", [("mk,nk->mn", (7, 33), (5, 33)),
                                       ("btkgh,bksh->bkgts", (2, 3, 2, 2, 7), (2, 2, 6, 7)),
                                       ("bkgts,bksh->btkgh", (2, 2, 2, 3, 6), (2, 2, 6, 5))])
def test_int8_einsum_pads_contractions_exactly(eq, sa, sb):
    """The padded-contraction einsum (a work-around for XLA on GPU) is the exact product."""
    rng = np.random.default_rng(5)
    a, b = _ints(rng, sa), _ints(rng, sb)
    got = pk.reference.int8_einsum(eq, a, b)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.einsum(eq, np.asarray(a, np.int64),
                                                 np.asarray(b, np.int64)))


def test_reference_norms_match_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 24))
    g, b = rng.random(24), rng.normal(size=24)
    ln = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    rms = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    np.testing.assert_allclose(pk.reference.normalize(f(x), "layernorm", f(g), f(b)), ln,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pk.reference.normalize(f(x), "rmsnorm", f(g)), rms, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_bmm(backend):
    rng = np.random.default_rng(4)
    B, M, Kb, Nb = 2, 5, 40, 9
    a, b = _ints(rng, (B, M, Kb)), _ints(rng, (B, Nb, Kb))
    sa = jnp.asarray(rng.random((B, M)), jnp.float32)
    sb = jnp.asarray(rng.random((B, Nb)), jnp.float32)
    got = pk.int8_bmm(a, b, sa, sb, backend=backend, interpret=True)
    acc = np.einsum("bmk,bnk->bmn", np.asarray(a, np.int64), np.asarray(b, np.int64))
    want = acc * np.asarray(sa)[..., None] * np.asarray(sb)[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(pk.int8_bmm(a, b, sa, sb, backend="xla"), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())


def test_dispatcher(monkeypatch):
    """By argument only: the environment is the CLI's default (jaxllm.config.Kernels.from_env),
    never read at trace time."""
    expect = {"gpu": "triton", "tpu": "tpu", "cpu": "cpu"}.get(jax.default_backend(), "xla")
    monkeypatch.setenv("JAXLLM_INT8_BACKEND", "triton")
    assert pk.resolve_backend() == pk.resolve_backend("auto") == expect
    assert pk.resolve_backend("tpu") == "tpu"
    with pytest.raises(ValueError, match="unknown INT8 backend 'cuda'"):
        pk.resolve_backend("cuda")
    from jaxllm.config import Kernels
    assert Kernels.from_env() == Kernels(int8="triton")
    monkeypatch.setenv("JAXLLM_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"unknown attention kernel 'flash'.*\$JAXLLM_ATTENTION"):
        Kernels.from_env()



@pytest.mark.skipif({d.platform for d in jax.devices()} != {"cpu"}, reason="a CPU-only machine")
def test_the_cli_picks_the_cpu_products_on_a_cpu_only_machine(monkeypatch):
    """With the CPU as the only platform, the CLI's "auto" products become "cpu" (the C++
    kernels, XLA's form elsewhere: no GPU or TPU kernel traced); a named choice stays."""
    from jaxllm.cli import common
    cfg, _, _ = common.load("random:pythia-14m", need_tokenizer=False)
    assert cfg.kernels.int8 == "cpu" and cfg.kernels.attention == "auto"
    monkeypatch.setenv("JAXLLM_INT8_BACKEND", "xla")
    cfg, _, _ = common.load("random:pythia-14m", need_tokenizer=False)
    assert cfg.kernels.int8 == "xla"

# ---- compiled on a GPU (Triton lowering): `pytest -m gpu`, skipped elsewhere -------------------
# Odd shapes (no dimension a block multiple) with the default blocks of every M regime and with
# explicit ones, against numpy int64 (exact) and float64 (the epilogue, to float32 rounding).
GPU_BLOCKS = [None, Blocks(16, 32, 64), Blocks(64, 64, 32, num_warps=4, num_stages=2),
              Blocks(128, 128, 128, num_warps=8, num_stages=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", GPU_BLOCKS, ids=lambda b: "default" if b is None else
                         f"{b.bm}x{b.bn}x{b.bk}")
@pytest.mark.parametrize("M", [1, 7, 37, 130, 1000])
def test_gpu_int8_product_is_exact(M, blocks):
    rng = np.random.default_rng(10 + M)
    Kg, Ng = 328, 200
    x, w = _ints(rng, (M, Kg)), _ints(rng, (Ng, Kg))
    got = pk.w8a8_matmul(x, w, 1.0, 1.0, out_dtype=jnp.int32, backend="triton", blocks=blocks)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(x, np.int64) @ np.asarray(w, np.int64).T)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 37, 300])
def test_gpu_epilogue_matches_float64(M):
    rng = np.random.default_rng(20 + M)
    Kg, Ng = 264, 136
    x, w = _ints(rng, (M, Kg)), _ints(rng, (Ng, Kg))
    sx = jnp.asarray(rng.random(M) + 0.1, jnp.float32)
    sw = jnp.asarray(rng.random(Ng) + 0.1, jnp.float32)
    b = jnp.asarray(rng.normal(size=Ng), jnp.float32)
    acc = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    want = acc * np.asarray(sx, np.float64)[:, None] * np.asarray(sw, np.float64)[None] + \
        np.asarray(b, np.float64)[None]
    got = pk.w8a8_matmul(x, w, sx, sw, b, out_dtype=jnp.float32, backend="triton")
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())
    got16 = pk.w8a8_matmul(x, w, sx, sw, b, out_dtype=jnp.bfloat16, backend="triton")
    np.testing.assert_allclose(np.asarray(got16, np.float64), want, rtol=8e-3,
                               atol=8e-3 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [None, "layernorm", "rmsnorm"])
@pytest.mark.parametrize("M,D", [(1, 768), (37, 200), (130, 4096)])
def test_gpu_fused_norm_quantize(norm, M, D):
    rng = np.random.default_rng(30 + M)
    x = jnp.asarray(rng.normal(size=(M, D)) * 3, jnp.float32)
    g = jnp.asarray(rng.random(D) + 0.5, jnp.float32)
    b = jnp.asarray(rng.normal(size=D), jnp.float32) if norm == "layernorm" else None
    q, s = pk.quantize_per_token(x, g if norm else None, b, norm=norm, backend="triton")
    qr, sr = pk.reference.quantize_per_token(x, norm, g, b)
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)
    diff = np.abs(np.asarray(q, np.int32) - np.asarray(qr, np.int32))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999  # a float rounding may cross a .5


@pytest.mark.gpu
def test_gpu_int8_bmm():
    rng = np.random.default_rng(40)
    B, M, Kb, Nb = 3, 37, 72, 130
    a, b = _ints(rng, (B, M, Kb)), _ints(rng, (B, Nb, Kb))
    sa = jnp.asarray(rng.random((B, M)), jnp.float32)
    sb = jnp.asarray(rng.random((B, Nb)), jnp.float32)
    got = pk.int8_bmm(a, b, sa, sb, backend="triton")
    acc = np.einsum("bmk,bnk->bmn", np.asarray(a, np.int64), np.asarray(b, np.int64))
    want = acc * np.asarray(sa, np.float64)[..., None] * np.asarray(sb, np.float64)[:, None]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_bad_shapes_are_named_before_lowering(backend):
    x, w = jnp.zeros((4, 32), jnp.int8), jnp.zeros((8, 16), jnp.int8)
    with pytest.raises(ValueError, match="same K"):
        pk.w8a8_matmul(x, w, 1.0, 1.0, backend=backend, interpret=True)
    with pytest.raises(ValueError, match=r"sw must be \[\] or \[N\]"):
        pk.w8a8_matmul(x, jnp.zeros((8, 32), jnp.int8), 1.0, jnp.ones(3), backend=backend,
                       interpret=True)
    with pytest.raises(ValueError, match="int8 operands"):
        pk.w8a8_matmul(x.astype(jnp.float32), jnp.zeros((8, 32), jnp.int8), 1.0, 1.0,
                       backend=backend, interpret=True)
    with pytest.raises(ValueError, match="gamma must be"):
        pk.quantize_per_token(jnp.ones((4, 32)), jnp.ones(16), norm="rmsnorm", backend=backend,
                              interpret=True)


# ---- the split-K kernel of decode's few rows (pallas_kernels.rows) -----------------------------
def _rows_want(x, w, sw, bias, mode):
    """numpy: per-token quantization (round half to even) and the int64 product (w8a8), or x
    rounded to bfloat16 times the int8 weight in float64 (w8); then the scales and bias."""
    if mode == "w8a8":
        sx = np.abs(np.asarray(x, np.float32)).max(-1) / np.float32(127)
        sx = np.where(sx > 0, sx, 1).astype(np.float32)
        q = np.clip(np.round(np.asarray(x, np.float32) / sx[:, None]), -127, 127)
        acc = q.astype(np.int64) @ np.asarray(w, np.int64).T
        y = acc * sx[:, None].astype(np.float64)
    else:
        xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        y = xb @ np.asarray(w, np.float64).T
    return y * np.asarray(sw, np.float64)[None, :] + np.asarray(bias, np.float64)[None, :]


@pytest.mark.parametrize("mode", ["w8a8", "w8"])
@pytest.mark.parametrize("M,N,Kr,splits", [(1, 80, 96, 1), (3, 64, 256, 3), (17, 48, 40, 1)])
def test_few_rows_split_over_k(mode, M, N, Kr, splits):
    """Blocks that do not divide N or K (padded), splits of K with a short last one: each row's
    quantization (w8a8) and the products are the definition's, to float32 rounding of the
    epilogue."""
    rng = np.random.default_rng(M * N + Kr)
    x = jnp.asarray(rng.standard_normal((M, Kr)) * 3, jnp.float32)
    w = _ints(rng, (N, Kr))
    sw = jnp.asarray(rng.random(N) * 0.01 + 1e-3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(N), jnp.float32)
    plan = pk.rows.Plan(32, 32, splits)
    got = pk.rows.int8_rows(x, w, sw, bias, mode=mode, plan=plan, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), _rows_want(x, w, sw, bias, mode),
                               rtol=2e-6, atol=2e-5)


def test_few_rows_dispatch_on_triton():
    """w8a8_matmul_per_token at decode's rows on ``triton`` takes the split-K kernel (its
    numbers: the per-token reference's, exactly in the int32 sums); many rows keep the GEMM."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    w = _ints(rng, (32, 64))
    got = pk.w8a8_matmul_per_token(x, w, 0.01, backend="triton", interpret=True)
    q, sx = pk.reference.quantize_per_token(x)
    np.testing.assert_allclose(got, pk.reference.w8a8_matmul(q, w, sx, jnp.full((32,), 0.01)),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="M <= 64"):
        pk.rows.int8_rows(jnp.zeros((65, 64)), w, 1.0)


@pytest.mark.parametrize("M,N,Kr", [(1, 11008, 4096), (8, 4096, 11008), (32, 32000, 4096),
                                    (1, 1536, 576)])
def test_few_rows_lower_for_gpu_without_padding(M, N, Kr):
    """Llama-2-7B's and SmolLM2's products lower for CUDA at decode's rows, with blocks that
    divide the weight (no padded copy of it) and enough programs for an H100's 132 SMs."""
    plan = pk.rows.plan_for(M, N, Kr)
    assert N % plan.bn == 0 and Kr % plan.bk == 0
    assert (N // plan.bn) * plan.splits >= 132 or plan.splits == Kr // plan.bk
    S = jax.ShapeDtypeStruct
    for mode in ("w8a8", "w8"):
        text = jax.jit(lambda x, w, sw: pk.rows.int8_rows(x, w, sw, mode=mode)).trace(
            S((M, Kr), jnp.bfloat16), S((N, Kr), jnp.int8), S((N,), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
        pads = [ln for ln in text.splitlines() if "stablehlo.pad" in ln]
        assert "__gpu$xla.gpu.triton" in text and not any("xi8>" in ln for ln in pads), pads


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w8a8", "w8"])
def test_gpu_few_rows_compiled(mode):
    """The compiled kernel (not interpreted) at Llama-2-7B's down projection, batch 8."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 11008)), jnp.float32)
    w = _ints(rng, (4096, 11008))
    sw = jnp.asarray(rng.random(4096) * 1e-3, jnp.float32)
    bias = jnp.zeros((4096,), jnp.float32)
    got = pk.rows.int8_rows(x, w, sw, bias, mode=mode)
    np.testing.assert_allclose(np.asarray(got, np.float64), _rows_want(x, w, sw, bias, mode),
                               rtol=1e-4, atol=1e-3)
