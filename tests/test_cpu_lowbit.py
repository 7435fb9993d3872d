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
