"""The hand-written int8 CPU kernel (pallas_kernels/cpu.py) against numpy's int64 products and
XLA's own int8 dot: its sums are exact, so results must be equal, not close. The kernel needs a
C++ compiler and AVX-512 VNNI; without them these tests skip (saying why) and the fallback is
checked instead."""
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA

import jaxllm
import pallas_kernels
from jaxllm import smoothquant as sq
from jaxllm.config import Kernels
from pallas_kernels import cpu, reference

needs_kernel = pytest.mark.skipif(not cpu.available(), reason=f"no kernel here: {cpu.status()}")
RNG = np.random.default_rng(0)


def uses_kernel(fn, *args) -> bool:
    return cpu.TARGET in str(jax.make_jaxpr(fn)(*args))


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 64, 1), (1, 768, 300), (3, 100, 7), (8, 3072, 65),
                                   (11, 1000, 33), (64, 130, 129)])
def test_int8_rows_are_numpys_exact_products(M, K, N):
    # the full int8 range, -128 included, and a K that is not a multiple of the 64-byte vector
    x = RNG.integers(-128, 128, (M, K)).astype(np.int8)
    w = RNG.integers(-128, 128, (N, K)).astype(np.int8)
    x[0, :] = -128  # the largest partial sums the kernel's offset trick must keep exact
    w[0, :] = -128
    got = np.asarray(jax.jit(cpu.int8_rows)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_array_equal(got, x.astype(np.int64) @ w.astype(np.int64).T)


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 300), (8, 100, 7), (13, 3072, 65)])
def test_int8_rows_token_quantizes_as_the_reference_then_multiplies(M, K, N):
    x = (RNG.standard_normal((M, K)) * 3).astype(np.float32)
    x[0, :3] = [127.0, 2.5, -0.5]  # scale 1: ties round to even, as jnp.round does
    if M > 1:
        x[1] = 0.0  # an all-zero row: scale 1
    if M > 2:
        x[2, 5], x[3, 1] = np.inf, 1e-42  # an infinite scale; a denormal
    w = RNG.integers(-128, 128, (N, K)).astype(np.int8)
    acc, sx = jax.jit(cpu.int8_rows_token)(jnp.asarray(x), jnp.asarray(w))
    # under jit, as the model runs it (XLA divides by the constant 127 as a product with 1/127)
    q, want_sx = jax.jit(reference.quantize_per_token)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(sx), np.asarray(want_sx))
    np.testing.assert_array_equal(np.asarray(acc),
                                  np.asarray(q, np.int64) @ w.astype(np.int64).T)


@needs_kernel
def test_w8a8_matmul_per_token_takes_one_kernel_call_and_equals_xla():
    M, K, N = 6, 192, 96
    x = jnp.asarray(RNG.standard_normal((M, K)).astype(np.float32))
    w = jnp.asarray(RNG.integers(-127, 128, (N, K)).astype(np.int8))
    sw = jnp.asarray(RNG.random(N).astype(np.float32))
    b = jnp.asarray(RNG.standard_normal(N).astype(np.float32))
    f = functools.partial(pallas_kernels.w8a8_matmul_per_token, sw=sw, bias=b)
    # The program lowered for the CPU (the jaxpr also holds the XLA branch that any other
    # platform compiles, cpu.on_cpu): the kernel, and no quantization outside it.
    hlo = jax.jit(f).lower(x, w).as_text()
    assert cpu.TOKEN_TARGET in hlo and "round_nearest" not in hlo
    q, sx = jax.jit(reference.quantize_per_token)(x)
    want = reference.w8a8_matmul(q, w, sx, sw, b)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w)), np.asarray(want))
    xla = jax.jit(functools.partial(f, backend="xla"))(x, w)
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(want))


@needs_kernel
def test_int8_kernels_name_bad_arguments():
    i8, f32 = jnp.ones((2, 8), jnp.int8), jnp.ones((2, 8), jnp.float32)
    w = jnp.ones((3, 8), jnp.int8)
    with pytest.raises(ValueError, match="int8_rows takes int8 x and int8 w, got float32"):
        cpu.int8_rows(f32, w)
    with pytest.raises(ValueError, match="int8_rows_token takes float32 x and int8 w, got int8"):
        cpu.int8_rows_token(i8, w)
    with pytest.raises(ValueError, match=r"needs x \[M, K\] and w \[N, K\] with the same K"):
        cpu.int8_rows_token(f32[:, :7], w)
    with pytest.raises(ValueError, match="needs K < 65536"):
        cpu.int8_rows(jnp.ones((1, cpu.MAX_K), jnp.int8), jnp.ones((1, cpu.MAX_K), jnp.int8))


@needs_kernel
@pytest.mark.parametrize("per_channel,bias", [(True, True), (False, False)])
def test_w8a8_matmul_takes_the_kernel_for_few_rows_and_equals_xla(per_channel, bias):
    M, K, N = 5, 192, 96
    x = jnp.asarray(RNG.integers(-127, 128, (M, K)).astype(np.int8))
    w = jnp.asarray(RNG.integers(-127, 128, (N, K)).astype(np.int8))
    sx = jnp.asarray(RNG.random(M).astype(np.float32))
    sw = jnp.asarray(RNG.random(N).astype(np.float32)) if per_channel else jnp.float32(0.02)
    b = jnp.asarray(RNG.standard_normal(N).astype(np.float32)) if bias else None

    def f(x, w):
        return pallas_kernels.w8a8_matmul(x, w, sx, sw, b)
    assert uses_kernel(f, x, w)
    assert not uses_kernel(lambda x, w: pallas_kernels.w8a8_matmul(x, w, sx, sw, b,
                                                                   backend="xla"), x, w)
    want = reference.w8a8_matmul(x, w, sx, jnp.broadcast_to(sw, (N,)), b)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w)), np.asarray(want))
    # the raw accumulator (out_dtype=int32) through the kernel: numpy's exact products
    acc = pallas_kernels.w8a8_matmul(x, w, sx, sw, out_dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(acc),
                                  np.asarray(x, np.int64) @ np.asarray(w, np.int64).T)
    # a prefill's many rows keep XLA's GEMM
    many = jnp.zeros((cpu.FEW_ROWS + 1, K), jnp.int8)
    assert not uses_kernel(lambda x: pallas_kernels.w8a8_matmul(x, w, 1.0, sw), many)


@needs_kernel
def test_w8a8_model_decodes_the_same_with_and_without_the_kernel():
    params = jaxllm.init_params(LLAMA, jax.random.key(3))
    ids = np.random.default_rng(1).integers(0, LLAMA.vocab_size, 3000)
    q = sq.quantize(params, LLAMA, ids, "o1", 0.8,
                    calib=sq.CalibConfig(n_seqs=4, seq_len=32, heldout_seqs=1))
    toks = jnp.asarray(ids[None, :6].repeat(2, 0))  # 12 rows: the kernel's range
    assert uses_kernel(lambda t: jaxllm.forward(q, LLAMA, t)[0], toks)
    with_kernel = jaxllm.forward(q, LLAMA, toks)[0]
    xla = dataclasses.replace(LLAMA, kernels=Kernels(int8="xla"))  # chosen by argument
    assert not uses_kernel(lambda t: jaxllm.forward(q, xla, t)[0], toks)
    without = jaxllm.forward(q, xla, toks)[0]
    np.testing.assert_array_equal(np.asarray(with_kernel), np.asarray(without))


def test_turned_off_by_the_environment():
    code = ("import jax.numpy as jnp, pallas_kernels; from pallas_kernels import cpu; "
            "print(cpu.status()); x = jnp.ones((2, 64), jnp.int8); "
            "print(pallas_kernels.w8a8_matmul(x, x, 1.0, 1.0).sum())")
    env = dict(os.environ, JAXLLM_CPU_KERNELS="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["int8 rows: XLA (turned off by JAXLLM_CPU_KERNELS=0)",
                   "4- and 8-bit rows: XLA (turned off by JAXLLM_CPU_KERNELS=0)",
                   "float rows: XLA (turned off by JAXLLM_CPU_KERNELS=0)",
                   "decode attention: XLA (turned off by JAXLLM_CPU_KERNELS=0)", "256.0"]


def test_a_missing_compiler_is_named_with_the_way_out(tmp_path):
    with pytest.raises(cpu.CPUKernelError, match="no C.. compiler.*JAXLLM_CPU_KERNELS=0"):
        cpu.build(cxx=str(tmp_path / "no-such-c++"), out_dir=tmp_path)


@pytest.mark.skipif(not cpu.enabled() or cpu.shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler")
def test_build_is_cached_and_leaves_no_partial_file(tmp_path):
    first = cpu.build(out_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
