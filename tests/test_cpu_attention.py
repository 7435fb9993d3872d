"""The decode-attention CPU kernel (pallas_kernels/csrc/decode_attention.cc) against a float64
numpy softmax-attention written from its definition, over every cache dtype it reads, head
dims and slot counts that are not multiples of its 16-lane vectors, grouped query heads,
RoPE's three rotations, ALiBi, softmax-off-by-one, masked slots, and heads split into chunks
of slots. The decode path through it is checked against the naive cache in tests/test_cache.py
(its ``attention_path`` fixture runs those tests by the kernel and by the jnp path). Without a
C++ compiler or AVX-512 these skip, saying why."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.attention_available(),
                                  reason=f"no kernel here: {cpu.status()}")


def attention64(k, v, q, pick, G, dist=None, slopes=None, zero_sink=False):
    """out[n, g] = softmax_c(k[n, c] . q[n, pick[b, c] * G + g] / sqrt(D) - slope * dist) @ v[n],
    masked slots (pick < 0) at -1e30, in float64 loops over heads."""
    k, v, q = (np.asarray(a, np.float64) for a in (k, v, q))
    N, C, D = k.shape
    KVH = N // pick.shape[0]
    out = np.zeros((N, G, D))
    for n in range(N):
        b = n // KVH
        rows = q[n].reshape(-1, G, D)[np.maximum(pick[b], 0)]  # [C, G, D]: each slot's rotation
        for g in range(G):
            s = np.einsum("cd,cd->c", k[n], rows[:, g]) / np.sqrt(D)
            if dist is not None:
                s = s - slopes[n, g] * dist[b]
            s = np.where(pick[b] >= 0, s, -1e30)
            if zero_sink:  # one more key: score 0, value 0
                s = np.concatenate([[0.0], s])
            p = np.exp(s - s.max())
            p = (p / p.sum())[1:] if zero_sink else p / p.sum()
            out[n, g] = p @ v[n]
    return out


CASES = {  # B, KVH, G, R, C, D, alibi, zero_sink
    "pythia layer": (1, 12, 1, 3, 256, 64, False, False),
    "GQA, odd dims, ALiBi": (2, 2, 3, 3, 37, 80, True, False),
    "one head, no RoPE, zero sink": (1, 1, 4, 1, 1000, 128, False, True),
    "tiny": (3, 2, 2, 3, 5, 8, False, False),
    "head dim 256, one slot": (1, 2, 1, 3, 1, 256, False, False),
    # few heads: each head's slots split in chunks, their partial sums combined
    "MQA in chunks, ALiBi, zero sink": (2, 1, 2, 3, 2500, 64, True, True),
    "one head in chunks": (1, 1, 1, 3, 3000, 80, False, False),
}


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 bits", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_is_softmax_attention(case, dtype):
    B, KVH, G, R, C, D, alibi, zero_sink = CASES[case]
    N = B * KVH
    rng = np.random.default_rng(len(case))
    narrow = {"float32": np.float32, "float16": np.float16}.get(dtype, ml_dtypes.bfloat16)
    k, v = (rng.normal(size=(N, C, D)).astype(narrow) for _ in range(2))
    q = (rng.normal(size=(N, R * G, D)) * 2).astype(np.float32)
    pick = rng.integers(-1, R, size=(B, C)).astype(np.int32)
    pick[:, 0] = 0  # at least one slot kept per row (a decode step keeps its own token)
    if B > 1:
        pick[-1] = -1  # and one row with every slot masked (a pool's idle row): nothing read
    dist = rng.integers(0, 300, size=(B, C)).astype(np.int32) if alibi else None
    slopes = rng.uniform(0, 0.1, size=(N, G)).astype(np.float32) if alibi else None
    want = attention64(k.astype(np.float32), v.astype(np.float32), q, pick, G, dist, slopes,
                       zero_sink)
    if B > 1:
        want[-KVH:] = 0.0  # the masked row's output: 0 (no value weighted)
    if dtype == "bfloat16 bits":  # a bfloat16 cache on CPU (jaxllm.kv.stores.Bf16Bits)
        k, v = k.view(np.uint16), v.view(np.uint16)
    got = jax.jit(cpu.decode_attention, static_argnums=4, static_argnames="zero_sink")(
        jnp.asarray(k), jnp.asarray(v), jnp.asarray(q), jnp.asarray(pick), G,
        dist=None if dist is None else jnp.asarray(dist),
        slopes=None if slopes is None else jnp.asarray(slopes), zero_sink=zero_sink)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_bad_shapes_and_dtypes_are_named():
    k = jnp.zeros((2, 8, 16))
    with pytest.raises(ValueError, match="k, v .N, C, D., q .N, R.G, D. and pick .B, C."):
        cpu.decode_attention(k, k, jnp.zeros((2, 3, 16)), jnp.zeros((1, 8), jnp.int32), 2)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        cpu.decode_attention(k.astype(jnp.int8), k.astype(jnp.int8), jnp.zeros((2, 1, 16)),
                             jnp.zeros((1, 8), jnp.int32), 1)
    with pytest.raises(ValueError, match="head dims up to 256"):
        big = jnp.zeros((1, 2, 264))
        cpu.decode_attention(big, big, jnp.zeros((1, 1, 264)), jnp.zeros((1, 2), jnp.int32), 1)


def test_decode_uses_the_kernel_where_available():
    """A decode step's jaxpr names the kernel exactly where it is available; the switch
    ``JAXLLM_CPU_KERNELS=0`` (checked in a fresh process) reports every kernel off."""
    from conftest import LLAMA

    import jaxllm
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    cache = jaxllm.init_cache(LLAMA, 1, sinks=2, window=6)
    jaxpr = str(jax.make_jaxpr(lambda p, c: jaxllm.forward(p, LLAMA, jnp.ones((1, 1), jnp.int32),
                                                           c))(params, cache))
    assert (cpu.ATTENTION_TARGET in jaxpr) == cpu.attention_available()
    code = "from pallas_kernels import cpu; print(cpu.status())"
    env = dict(os.environ, JAXLLM_CPU_KERNELS="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["int8 rows: XLA (turned off by JAXLLM_CPU_KERNELS=0)",
                   "4- and 8-bit rows: XLA (turned off by JAXLLM_CPU_KERNELS=0)",
                   "float rows: XLA (turned off by JAXLLM_CPU_KERNELS=0)",
                   "decode attention: XLA (turned off by JAXLLM_CPU_KERNELS=0)"]


@needs_kernel
def test_a_program_lowered_for_a_gpu_never_calls_the_cpu_kernels():
    """The kernels are registered for XLA:CPU alone. A decode step traced in this CPU process
    but lowered for CUDA (as a program placed on a GPU would be) holds neither kernel's call,
    while the same step lowered for the CPU holds both (cpu.on_cpu: lax.platform_dependent)."""
    from conftest import LLAMA

    import jaxllm
    from jaxllm import smoothquant as sq
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    ids = np.random.default_rng(1).integers(0, LLAMA.vocab_size, 600)
    q = sq.quantize(params, LLAMA, ids, "o1", 0.8,
                    calib=sq.CalibConfig(n_seqs=2, seq_len=16, heldout_seqs=1))
    cache = jaxllm.init_cache(LLAMA, 1, sinks=2, window=6)
    traced = jax.jit(lambda p, c: jaxllm.forward(p, LLAMA, jnp.ones((1, 1), jnp.int32), c)
                     ).trace(q, cache)
    on_cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    on_gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    for target in (cpu.ATTENTION_TARGET,) + ((cpu.TOKEN_TARGET,) if cpu.available() else ()):
        assert target in on_cpu and target not in on_gpu, target
