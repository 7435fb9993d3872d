"""The Pallas low-bit product (pallas_kernels.packed_matmul): both lowerings interpreted on CPU
against a numpy unpack-dequantize-matmul written here, and both lowered for their devices at
the shapes we ship (Llama-2-7B's, SmolLM2's; GPTQ's group 128, GGUF's 32, per-channel)."""
import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxllm import lowbit
from pallas_kernels import packed_matmul as pm


def _numpy_product(x, codes, scale, offset, G, round_bf16=False):
    """x [M, K] @ ŵᵀ in float64, ŵ = code·scale + offset per group (the last one ragged); with
    ``round_bf16`` x and ŵ rounded to bfloat16 first, as a bfloat16 model's kernel does."""
    K = codes.shape[1]
    w = codes * np.repeat(scale, G, 1)[:, :K] + np.repeat(offset, G, 1)[:, :K]
    if round_bf16:
        x, w = (np.asarray(a, np.float32).astype(ml_dtypes.bfloat16) for a in (x, w))
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("bits,G,M,N,K,splits", [
    (4, 128, 3, 64, 576, 2),    # GPTQ's groups, ragged into 576; the last block moved back
    (4, 32, 5, 32, 576, 1),     # GGUF Q4's groups: a block spans 17 of them
    (2, 256, 1, 32, 1024, 2),   # 16 codes a word
    (8, 64, 17, 32, 200, 3),    # bytes, 200 columns: splits over 4 blocks (the last moved)
    (4, 576, 70, 16, 576, 1),   # per-channel (one group); 70 rows: two row blocks
])
@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_packed_product_is_numpy_unpack_dequantize_matmul(bits, G, M, N, K, splits, backend):
    rng = np.random.default_rng(bits * 1000 + M)
    ng = -(-K // G)
    codes = rng.integers(0, 2 ** bits, (N, K))
    scale = rng.uniform(0.01, 0.1, (N, ng)).astype(np.float32)
    offset = rng.standard_normal((N, ng)).astype(np.float32)
    node = lowbit.encode(codes, scale, offset, bits, G)  # packs (its own test checks how)
    x = rng.standard_normal((M, K)).astype(np.float32)
    assert pm.supports(bits, G, K, N, backend) is None
    plan = None
    if backend == "triton":
        plan = pm.plan_for(M, N, node.codes.shape[1])
        plan = pm.Plan(plan.bm, plan.bn, plan.bw, splits)
    got = pm.lowbit_matmul(jnp.asarray(x), node.codes, node.scale, node.offset, bits=bits,
                           group=G, in_features=K, dtype=jnp.float32, backend=backend,
                           plan=plan, interpret=True)
    want = _numpy_product(x, codes, scale, offset, G)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5,
                               atol=2e-5 * np.abs(want).max())


def test_bfloat16_rounds_x_and_the_dequantized_weight_once():
    """A bfloat16 model: x and ŵ rounded to bfloat16, products summed in float32."""
    rng = np.random.default_rng(3)
    N, K, G = 64, 512, 128
    codes = rng.integers(0, 16, (N, K))
    scale = rng.uniform(0.01, 0.1, (N, K // G)).astype(np.float32)
    offset = rng.standard_normal((N, K // G)).astype(np.float32)
    node = lowbit.encode(codes, scale, offset, 4, G)
    x = rng.standard_normal((2, K)).astype(np.float32)
    got = pm.lowbit_matmul(jnp.asarray(x, jnp.bfloat16), node.codes, node.scale, node.offset,
                           bits=4, group=G, in_features=K, dtype=jnp.bfloat16,
                           interpret=True)
    want = _numpy_product(x, codes, scale, offset, G, round_bf16=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    ref = pm.reference(jnp.asarray(x), node.codes, node.scale, node.offset, bits=4, group=G,
                       in_features=K, dtype=jnp.bfloat16)  # the jnp form beside the kernel
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_weights_the_kernel_does_not_take_say_why():
    assert "3-bit" in pm.supports(3, 128, 576, 576)
    assert "split a word" in pm.supports(4, 12, 576, 576)
    assert "no power-of-two block" in pm.supports(4, 128, 576, 24)
    assert "groups of 32 columns" in pm.supports(4, 32, 11008, 4096, "tpu")
    with pytest.raises(ValueError, match="3-bit codes"):
        pm.lowbit_matmul(jnp.zeros((1, 576)), jnp.zeros((8, 58), jnp.uint32),
                         jnp.zeros((8, 5)), jnp.zeros((8, 5)), bits=3, group=128,
                         in_features=576, interpret=True)


SHAPES = [(1, 4096, 4096), (8, 11008, 4096), (1, 4096, 11008), (512, 4096, 4096),
          (1, 576, 576), (1, 192, 576), (1, 1536, 576), (1, 576, 1536)]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernel_lowers_for_its_device_at_the_shapes_we_ship(platform):
    """Llama-2-7B (batch 1, 8, a 512-token prefill) and SmolLM2 linears, 4-bit groups of 128
    and 32, 8-bit, 2-bit: Pallas' Triton or Mosaic TPU lowering runs (it refuses what the
    device would); a weight the kernel does not take must say so in ``supports``."""
    backend = "triton" if platform == "cuda" else "tpu"
    S = jax.ShapeDtypeStruct
    lowered = 0
    for M, N, K in SHAPES:
        for bits, G in [(4, 128), (4, 32), (8, 32), (2, 128)]:
            if pm.supports(bits, G, K, N, backend) is not None:
                continue
            per = pm.per_word(bits)

            def f(x, c, s, o):
                return pm.lowbit_matmul(x, c, s, o, bits=bits, group=G, in_features=K,
                                        backend=backend)
            text = jax.jit(f).trace(
                S((M, K), jnp.bfloat16),
                S((N, -(-K // per)), jnp.uint32 if per > 1 else jnp.uint8),
                S((N, -(-K // G)), jnp.float16), S((N, -(-K // G)), jnp.float16)).lower(
                lowering_platforms=(platform,)).as_text()
            assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") \
                in text
            lowered += 1
    assert lowered >= (32 if platform == "cuda" else 27)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,G,M,N,K", [(4, 128, 1, 4096, 4096), (4, 32, 8, 4096, 4096),
                                          (8, 32, 3, 576, 1536), (2, 128, 37, 1536, 576),
                                          (4, 128, 300, 11008, 4096)])
def test_gpu_packed_product_is_numpy_unpack_dequantize_matmul(bits, G, M, N, K):
    """Compiled on the GPU (bfloat16 operands, the model's dtype there), against numpy."""
    rng = np.random.default_rng(bits + M)
    ng = -(-K // G)
    codes = rng.integers(0, 2 ** bits, (N, K))
    scale = rng.uniform(0.01, 0.1, (N, ng)).astype(np.float32)
    offset = (0.1 * rng.standard_normal((N, ng))).astype(np.float32)
    node = lowbit.encode(codes, scale, offset, bits, G)
    x = rng.standard_normal((M, K)).astype(np.float32)
    got = pm.lowbit_matmul(jnp.asarray(x, jnp.bfloat16), node.codes, node.scale, node.offset,
                           bits=bits, group=G, in_features=K, dtype=jnp.bfloat16)
    want = _numpy_product(x, codes, scale, offset, G, round_bf16=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
