"""The 4- and 8-bit CPU kernel (pallas_kernels/csrc/lowbit_rows.cc) against numpy's float64 product
with the dequantized weight: the kernel sums in float32 in another order than XLA, so results
are close (to float32 rounding), not equal. It needs a C++ compiler and AVX2 with FMA and F16C;
without them these tests skip (saying why) and XLA's form is checked to be used instead."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import lowbit
from pallas_kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.lowbit_available(),
                                  reason=f"no kernel here: {cpu.status()}")
RNG = np.random.default_rng(0)


def node(out, n, group, dtype, bits=4):
    codes = RNG.integers(0, 1 << bits, (out, n)).astype(np.uint8)
    codes[0] = (1 << bits) - 1  # the largest code in every field of the first row
    scale = RNG.uniform(0.01, 0.02, (out, -(-n // group))).astype(dtype)
    offset = (RNG.uniform(-0.2, 0.0, scale.shape)).astype(dtype)
    return lowbit.encode(codes, scale, offset, bits, group)


@needs_kernel
@pytest.mark.parametrize("M,N,K,group,dtype,bits", [
    (1, 1536, 576, 32, np.float16, 4),  # SmolLM2's MLP up, Q4_1 (two groups a 256-bit load)
    (3, 576, 1536, 128, np.float32, 4),  # RTN's groups of 128
    (9, 100, 200, 8, np.float32, 4),  # more rows than one pass, a group a word
    (2, 33, 70, 16, np.float16, 4),  # K not a multiple of 8: the last word half padding
    (8, 17, 64, 64, np.float32, 4),  # one load a row
    (1, 35, 200, 8, np.float32, 4),  # one row: weight rows 4 at a time, then 3 alone
    (2, 7, 96, 32, np.float16, 4),  # two rows: weight rows 2 at a time, then one alone
    (1, 37, 160, 32, np.float32, 4),  # float32 pairs of scales, the last load's second past K
    (1, 9, 192, 96, np.float16, 4),  # a group neither one a load nor two: a scale a lane
    (1, 3000, 576, 32, np.float16, 8),  # SmolLM2's Q8_0 head, some of its rows
    (10, 40, 131, 16, np.float32, 8),  # K not a multiple of 8; two passes over the rows
    (1, 35, 131, 16, np.float16, 8),  # one row: weight rows 4 at a time, then 3 alone
    (2, 7, 96, 32, np.float32, 8),  # two rows: weight rows 2 at a time, then one alone
])
def test_the_kernel_is_numpys_product_with_the_dequantized_weight(M, N, K, group, dtype, bits):
    w = node(N, K, group, dtype, bits)
    x = RNG.standard_normal((M, K)).astype(np.float32)
    want = x.astype(np.float64) @ lowbit.numpy_dequantize(w).T
    got = np.asarray(jax.jit(lambda x, w: cpu.lowbit_rows(x, w.codes, w.scale, w.offset,
                                                          w.bits, w.group))(x, w))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() * np.sqrt(K))


@needs_kernel
@pytest.mark.parametrize("bits,int8_x", [(4, False), (4, True), (8, False), (8, True)])
def test_zero_rows_of_x_are_zero_products_and_the_rest_unchanged(bits, int8_x):
    """Rows of x that are all zero (a batch's rows a decode step leaves alone) come out as exact
    zeros, and the other rows as numpy's product, whether one, some or all rows are zero."""
    w = node(300, 576, 32, np.float16, bits)
    x = RNG.standard_normal((8, 576)).astype(np.float32)
    f = jax.jit(lambda x, w: cpu.lowbit_rows(x, w.codes, w.scale, w.offset, w.bits, w.group,
                                             int8_x=int8_x))
    xr = np.asarray(lowbit.round_blocks(jnp.asarray(x))) if int8_x else x
    want = xr.astype(np.float64) @ lowbit.numpy_dequantize(w).T
    for zero in ([3], [0, 1, 2, 4, 5, 6, 7], list(range(8))):
        xz = x.copy()
        xz[zero] = 0.0
        got = np.asarray(f(xz, w))
        live = [m for m in range(8) if m not in zero]
        assert not got[zero].any()
        np.testing.assert_allclose(got[live], want[live], rtol=0,
                                   atol=2e-6 * np.abs(want).max() * np.sqrt(576))


@needs_kernel
def test_decode_rows_take_the_kernel_and_a_prefill_keeps_xla():
    """lowbit.matmul sends a few rows of 4-bit codes to the kernel (its FFI target in the
    compiled CPU program) and many rows or 3-bit codes to XLA's form; both give the same
    products."""
    w = node(64, 256, 32, np.float16)
    for rows, bits_node, kernel in ((1, w, True), (16, w, True), (17, w, False),
                                    (1, lowbit.encode(np.zeros((64, 256), np.uint8), np.ones(
                                        (64, 8), np.float32), np.zeros((64, 8), np.float32), 3,
                                        32), False)):
        x = jnp.asarray(RNG.standard_normal((rows, 256)), jnp.float32)
        f = jax.jit(lambda x, n: lowbit.matmul(x, n))
        text = f.lower(x, bits_node).compile().as_text()
        assert (cpu.LOWBIT_TARGET in text) == kernel, (rows, bits_node.bits)
        np.testing.assert_allclose(np.asarray(f(x, bits_node)),
                                   np.asarray(lowbit.xla_matmul(x, bits_node)), rtol=2e-5,
                                   atol=2e-5)


@needs_kernel
def test_the_cpu_backend_traces_no_pallas_kernel_and_lowers_elsewhere_to_xla():
    """backend="cpu" (what the CLI picks on a CPU-only machine): the C++ kernel in a CPU
    program, XLA's form in a GPU or TPU one, and no Pallas kernel in the trace; the product
    equals the "auto" choice's."""
    w = node(64, 256, 32, np.float16)
    x = jnp.asarray(RNG.standard_normal((2, 256)), jnp.float32)
    jitted = {b: jax.jit(lambda x, n, b=b: lowbit.matmul(x, n, backend=b)) for b in ("auto", "cpu")}
    assert "pallas_call" in str(jitted["auto"].trace(x, w).jaxpr)
    traced = jitted["cpu"].trace(x, w)
    assert "pallas_call" not in str(traced.jaxpr)
    assert cpu.LOWBIT_TARGET in jitted["cpu"].lower(x, w).compile().as_text()
    for platform in ("cuda", "tpu"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert cpu.LOWBIT_TARGET not in text and "custom_call" not in text, platform
    np.testing.assert_array_equal(np.asarray(jitted["cpu"](x, w)),
                                  np.asarray(jitted["auto"](x, w)))


def np_round_blocks(x):
    """numpy's x rounded to 8 bits per 32 columns: d = max|x| / 127 (as float32 times 1/127),
    round half to even."""
    x = np.asarray(x, np.float32)
    out = np.zeros_like(x)
    for j in range(0, x.shape[-1], 32):
        b = x[..., j:j + 32]
        d = np.max(np.abs(b), axis=-1, keepdims=True) * np.float32(1 / 127)
        q = np.where(d > 0, np.clip(np.round(b / np.where(d > 0, d, 1)), -127, 127), 0)
        out[..., j:j + 32] = q * d
    return out


def test_round_blocks_is_numpys_rounding():
    x = RNG.standard_normal((3, 70)).astype(np.float32)
    x[1, 32:64] = 0  # an all-zero block stays zero
    x[2, :32] = np.arange(32) * (127 / 31)  # ties: halves rounded to even
    np.testing.assert_array_equal(np.asarray(lowbit.round_blocks(jnp.asarray(x))),
                                  np_round_blocks(x))


@needs_kernel
@pytest.mark.parametrize("M,N,K,group,dtype,bits", [
    (1, 1536, 576, 32, np.float16, 4),  # SmolLM2's MLP up, Q4_1: the vectorised scale setup
    (3, 64, 200, 64, np.float32, 4),  # K not a multiple of 64; groups of two blocks
    (2, 33, 70, 32, np.float16, 4),  # a short last block; weight rows 4 at a time, then 1
    (9, 20, 1536, 128, np.float16, 4),  # more rows than one pass
    (1, 3000, 576, 32, np.float16, 8),  # SmolLM2's Q8_0 head, some of its rows
    (2, 33, 70, 32, np.float32, 8),  # a short last block
    (3, 40, 256, 128, np.float16, 8),  # groups of four blocks
])
def test_int8_inputs_are_numpys_product_with_x_rounded(M, N, K, group, dtype, bits):
    """act="block": the kernel rounds x per 32 columns (to the bit as numpy does) and multiplies
    integers: numpy's float64 product of the rounded x and the dequantized weight, to float32
    rounding; XLA's form (``kernels.int8="xla"``) gives the same. Without the rounding the
    products differ by more than that: the rounding is really applied."""
    w = node(N, K, group, dtype, bits).replace(act="block")
    x = RNG.standard_normal((M, K)).astype(np.float32)
    want = np_round_blocks(x).astype(np.float64) @ lowbit.numpy_dequantize(w).T
    tol = 2e-6 * np.abs(want).max() * np.sqrt(K)
    f = jax.jit(lambda x, w: lowbit.matmul(x, w))
    assert 'int8_x = true' in f.lower(x, w).as_text()
    np.testing.assert_allclose(np.asarray(f(x, w)), want, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(lowbit.matmul(x, w, backend="xla")), want, rtol=0,
                               atol=tol)
    plain = np.asarray(lowbit.matmul(x, w.replace(act="none")))
    assert np.abs(plain - want).max() > 10 * tol


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_rounded_inputs_lower_to_the_pallas_kernel_on_gpu_and_tpu(platform):
    """A node with act="block" lowered for a GPU or TPU on this CPU: its x is rounded by
    round_blocks (its max and round ops are in the program) and the product is the packed
    Pallas kernel, not the CPU's FFI call."""
    w = node(256, 512, 32, np.float16).replace(act="block")
    x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
    text = jax.jit(lambda x, w: lowbit.matmul(x, w, jnp.bfloat16)).trace(x, w).lower(
        lowering_platforms=(platform,)).as_text()
    assert cpu.LOWBIT_TARGET not in text
    assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text
    assert "stablehlo.round_nearest_even" in text


def test_round_inputs_marks_4_bit_nodes_in_blocks_and_survives_saving(tmp_path):
    """lowbit.round_inputs: 4-bit nodes with groups of whole 32-column blocks take rounded
    inputs, others not; the choice is saved with the model; a model without such nodes is
    refused in one line."""
    import dataclasses
    import jaxllm
    from conftest import LLAMA
    from jaxllm import gptq, tree
    cfg = dataclasses.replace(LLAMA, num_layers=1, hidden_size=64, intermediate_size=128)
    params = jaxllm.init_params(cfg, jax.random.key(0))
    toks = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size))
    q, _ = gptq.quantize_model(params, cfg, toks, gptq.GPTQConfig("rtn", bits=4, group=32))
    r = lowbit.round_inputs(q)
    acts = {k: v.act for k, v in tree.flatten(r).items() if isinstance(v, lowbit.QLowBit)}
    assert set(acts.values()) == {"block"} and len(acts) == 7
    jaxllm.save_model(str(tmp_path / "m"), cfg, r)
    _, back, _ = jaxllm.load_model(str(tmp_path / "m"))
    assert {k: v.act for k, v in tree.flatten(back).items()
            if isinstance(v, lowbit.QLowBit)} == acts
    q16, _ = gptq.quantize_model(params, cfg, toks, gptq.GPTQConfig("rtn", bits=4, group=16))
    with pytest.raises(ValueError, match="no 4- or 8-bit weights in groups of a multiple of"):
        lowbit.round_inputs(q16)


@needs_kernel
def test_two_threads_in_the_kernel_at_once_each_get_their_product():
    """Two calls at once (XLA runs independent products, a layer's q, k and v, on two threads;
    or two programs): they share XLA's pool (csrc/blocks.h), neither waits for the other's
    pieces, and each row is summed by one thread in a fixed order, so every result equals the
    call's result alone."""
    import threading
    ws = [node(512, 256, 32, np.float16) for _ in range(2)]
    xs = [RNG.standard_normal((1, 256)).astype(np.float32) for _ in range(2)]
    f = jax.jit(lambda x, w: cpu.lowbit_rows(x, w.codes, w.scale, w.offset, 4, 32))
    want = [np.asarray(f(x, w)) for x, w in zip(xs, ws)]
    for x, w, got in zip(xs, ws, want):  # each alone is numpy's product
        ref = x.astype(np.float64) @ lowbit.numpy_dequantize(w).T
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max() * 16)
    same = [[], []]

    def calls(i):
        for _ in range(200):
            same[i].append(np.array_equal(np.asarray(f(xs[i], ws[i])), want[i]))
    threads = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(s) for s in same] == [200, 200] and all(same[0]) and all(same[1])


@needs_kernel
def test_bad_arguments_are_named():
    w = node(8, 64, 32, np.float32)
    with pytest.raises(ValueError, match="group a multiple of 8"):
        cpu.lowbit_rows(jnp.ones((1, 64)), w.codes, w.scale, w.offset, 4, 12)
    with pytest.raises(ValueError, match="one float dtype"):
        cpu.lowbit_rows(jnp.ones((1, 64)), w.codes, w.scale, w.offset.astype(jnp.float16), 4, 32)
    with pytest.raises(ValueError, match="8-bit"):
        cpu.lowbit_rows(jnp.ones((1, 64)), w.codes, w.scale, w.offset, 8, 32)


@pytest.mark.skipif(cpu.lowbit_available(), reason="the kernel is available here")
def test_without_the_kernel_xla_multiplies():
    w = node(8, 64, 32, np.float32)
    text = jax.jit(lambda x, n: lowbit.matmul(x, n)).lower(jnp.ones((1, 64)), w).as_text()
    assert cpu.LOWBIT_TARGET not in text
