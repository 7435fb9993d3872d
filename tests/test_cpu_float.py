"""The float and int8 weight-only CPU kernel (pallas_kernels/csrc/float_rows.cc) against numpy's
float64 product: the kernel sums in float32 in another order than XLA, so results are close (to
float32 rounding), not equal. It needs a C++ compiler and AVX-512 or AVX2 with FMA and F16C;
without them these tests skip, saying why."""
import ctypes
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.weight_only import VECMAT_MAX_IN, weight_only_matmul
from pallas_kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.float_available(),
                                  reason=f"no kernel here: {cpu.status()}")
RNG = np.random.default_rng(0)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8)


def weight(n, k, dtype):
    if dtype == jnp.int8:
        return jnp.asarray(RNG.integers(-127, 128, (n, k)), jnp.int8)
    return jnp.asarray(RNG.standard_normal((n, k)), jnp.float32).astype(dtype)


def numpy_product(x, w):
    """x @ wᵀ in float64 from the weight's own values."""
    return np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T


def close(got, want, k):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() * np.sqrt(k))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("M,N,K", [
    (1, 1536, 576),  # SmolLM2's MLP up
    (4, 576, 1536),  # its MLP down, a decode batch of 4
    (3, 37, 200),  # K not a multiple of a step (32 columns, 16 with AVX2): a tail
    (2, 9, 20),  # K shorter than a step: the tail alone
    (9, 70, 96),  # more rows than one pass (4)
    (1, 3, 4096),  # a wide input
])
def test_the_kernel_is_numpys_product(M, N, K, dtype):
    w = weight(N, K, dtype)
    x = RNG.standard_normal((M, K)).astype(np.float32)
    got = np.asarray(jax.jit(cpu.float_rows)(x, w))
    close(got, numpy_product(x, w), K)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8], ids=lambda d: jnp.dtype(d).name)
def test_zero_rows_of_x_are_zero_products_and_the_rest_unchanged(dtype):
    """Rows of x that are all zero (a batch's rows a decode step leaves alone) come out as exact
    zeros, and the other rows as numpy's product, whether one, some or all rows are zero."""
    w = weight(300, 576, dtype)
    x = RNG.standard_normal((4, 576)).astype(np.float32)
    want = numpy_product(x, w)
    f = jax.jit(cpu.float_rows)
    for zero in ([2], [0, 1, 3], [0, 1, 2, 3]):
        xz = x.copy()
        xz[zero] = 0.0
        got = np.asarray(f(xz, w))
        live = [m for m in range(4) if m not in zero]
        assert not got[zero].any()
        if live:
            close(got[live], want[live], 576)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_weight_only_products_take_the_kernel_where_xla_reads_slower(dtype):
    """weight_only_matmul sends 2-4 rows, and one or two rows of an input wider than XLA fuses,
    to the kernel (its FFI target in the compiled CPU program); one row of a narrower input,
    more rows and backend="xla" to XLA's forms; each is numpy's product times the scale, and a
    program lowered for a GPU or TPU calls no CPU target."""
    scale = jnp.asarray(RNG.uniform(0.5, 2.0, 48), jnp.float32)
    wide = VECMAT_MAX_IN + 32
    for rows, k, backend, kernel in ((1, 256, "auto", False), (2, 256, "auto", True),
                                     (4, 256, "auto", True), (5, 256, "auto", False),
                                     (1, wide, "auto", True), (2, wide, "auto", True),
                                     (3, wide, "auto", False), (3, 256, "xla", False)):
        w = weight(48, k, dtype)
        x = jnp.asarray(RNG.standard_normal((rows, k)), jnp.float32)
        f = jax.jit(lambda x, w, s, b=backend: weight_only_matmul(x, w, s, backend=b))
        assert (cpu.FLOAT_TARGET in f.lower(x, w, scale).compile().as_text()) == kernel, \
            (rows, k, backend)
        close(np.asarray(f(x, w, scale)), numpy_product(x, w) * np.asarray(scale), k)
        if kernel:
            for platform in ("cuda", "tpu"):
                text = f.trace(x, w, scale).lower(lowering_platforms=(platform,)).as_text()
                assert cpu.FLOAT_TARGET not in text, platform


@needs_kernel
def test_the_avx2_path_is_numpys_product_too(tmp_path):
    """The kernel built for AVX2 (-mno-avx512f), as on a CPU without AVX-512, called through a
    target of its own: numpy's product for every weight dtype, with tails and several rows.
    (On a machine without AVX-512 this is the build the other tests use.)"""
    lib = ctypes.CDLL(str(cpu.build(out_dir=tmp_path, sources=(cpu.CSRC / "float_rows.cc",),
                                    extra_flags=("-mno-avx512f",))))
    assert lib.jaxllm_float_rows_isa() == 256
    target = "jaxllm_float_rows_avx2_test"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxllmFloatRows), platform="cpu")
    for dtype in DTYPES:
        for M, N, K in ((1, 70, 576), (4, 33, 100), (6, 9, 7)):
            w = weight(N, K, dtype)
            x = RNG.standard_normal((M, K)).astype(np.float32)
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((M, N), jnp.float32))
            close(np.asarray(jax.jit(call)(x, w)), numpy_product(x, w), K)


@needs_kernel
def test_the_kernel_refuses_shapes_it_does_not_take():
    with pytest.raises(ValueError, match="same K"):
        cpu.float_rows(jnp.ones((1, 8)), jnp.ones((3, 9), jnp.bfloat16))
    with pytest.raises(ValueError, match="int8"):
        cpu.float_rows(jnp.ones((1, 8)), jnp.ones((3, 8), jnp.uint8))


@needs_kernel
@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags")
def test_the_status_names_the_kernel_and_the_cpus_instructions():
    """status_line finds the float kernel's line of status(), which names AVX-512 exactly when
    the CPU's own flags (/proc/cpuinfo; the build is -march=native) have AVX-512 F and BW."""
    flags = next(x for x in open("/proc/cpuinfo") if x.startswith("flags")).split()
    isa = "AVX-512" if {"avx512f", "avx512bw"} <= set(flags) else "AVX2"
    assert cpu.status_line("float rows") == f"float rows: {isa} kernel"
