"""The stored-format decode kernel (pallas_kernels.decode): every storage format, read as stored
and dequantized in registers, against the jnp reference (pallas_kernels.reference.decode_partials) that dequantizes whole arrays and turns
each key by its own angle; then whole decode steps through a wrapping sink + ring cache, kernel
(interpreted) against the XLA form; and both lowerings at the shapes we ship."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.config import Kernels
from jaxllm.kv import quantized as kq
from jaxllm.model import apply
from pallas_kernels import decode as kd
from pallas_kernels import reference


def _stored(rng, lay: kd.Layout, N: int, L: int, D: int):
    """Random keys or values [N, L, D] in ``lay``, quantized by jaxllm.kv.quantized (KIVI's
    per-channel keys: each channel over groups of ``lay.group`` slots)."""
    x = jnp.asarray(rng.standard_normal((N, L, D)) * 2, jnp.float32)
    if lay.kind == "float":
        return (x.astype(jnp.bfloat16),)
    if lay.kind == "int8":
        return kq.quantize(x, kq.KVQuant("int8", 8))[:2]
    spec = kq.KVQuant("token", lay.bits, lay.group if lay.kind == "token" else 0)
    if lay.kind == "token":
        q, s, o = kq.quantize(x, spec)
        return (kq.pack(q, lay.bits) if spec.packed else q), s, o
    xg = x.reshape(N, L // lay.group, lay.group, D).swapaxes(-1, -2)  # [N, L/g, D, g]
    q, s, o = kq.quantize(xg, spec)
    q = q.swapaxes(-1, -2).reshape(N, L, D)
    return (kq.pack(q, lay.bits) if spec.packed else q,
            kd.permute(s[..., 0], lay.per), kd.permute(o[..., 0], lay.per))


CASES = {  # keys, values, head dim, slots, block, backend
    "bfloat16, GQA 3 x 3": (kd.Layout("float"), kd.Layout("float"), 16, 37, 8, "triton"),
    "int8 per token": (kd.Layout("int8", 8), kd.Layout("int8", 8), 16, 37, 8, "tpu"),
    "4-bit, groups of 8 channels": (kd.Layout("token", 4, 8), kd.Layout("token", 4), 16, 29,
                                    8, "triton"),
    "3-bit keys, 8-bit values": (kd.Layout("token", 3), kd.Layout("token", 8, 4), 16, 37, 8,
                                 "triton"),
    "2-bit per token": (kd.Layout("token", 2), kd.Layout("token", 2, 16), 32, 21, 16,
                        "triton"),
    "KIVI-2 (per-channel keys)": (kd.Layout("channel", 2, 8), kd.Layout("token", 2), 32, 24,
                                  8, "triton"),
    "one block of one slot": (kd.Layout("int8", 8), kd.Layout("float"), 16, 1, 1, "triton"),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_reads_each_format_as_the_reference(case):
    """Odd sizes (3 KV heads of 3 query heads, slots not a multiple of the block, more splits
    than some rows need), three query rotations picked per slot, masked slots, ALiBi and keys
    turned after dequantizing (YaRN-scaled): the kernel's splits, merged, give the reference's
    attention to float32 rounding (the angle-sum rotation differs from the direct one by the
    rounding of the angle)."""
    kl, vl, D, L, bk, backend = CASES[case]
    rng = np.random.default_rng(L * D)
    B, KVH, G, Rq = 2, 3, 3, 3
    N = B * KVH
    keys, values = _stored(rng, kl, N, L, D), _stored(rng, vl, N, L, D)
    q = kd.permute(jnp.asarray(rng.standard_normal((N, Rq, G, D)), jnp.float32), kl.per)
    pick = jnp.asarray(rng.integers(-1, Rq, (B, L)), jnp.int32).at[:, 0].set(0)
    dist = jnp.asarray(rng.integers(0, 60, (B, L)), jnp.int32)
    slopes = jnp.asarray(rng.random((N, G)) * 0.1, jnp.float32)
    rope = kd.Rope(jnp.asarray(1.0 / 50.0 ** (np.arange(D // 2) / (D // 2)) * np.ones((B, 1)),
                               jnp.float32), -L, 1.1)
    kw = dict(k_layout=kl, v_layout=vl)
    m, l, acc = kd.partials(q, keys, values, pick, dist, slopes, rope, splits=3, bk=bk,
                            backend=backend, interpret=True, **kw)
    m, l, acc = kd.merge(m, l, acc, axis=1)
    rm, rl, racc = reference.decode_partials(q, keys, values, pick, dist, slopes, rope, **kw)
    np.testing.assert_allclose(acc / l[..., None], racc / rl[..., None], atol=3e-5, rtol=1e-4)


def test_unreadable_layouts_are_refused_by_name():
    assert "power of two" in kd.supports(kd.Layout("float"), kd.Layout("float"), 48, False,
                                         64, 16)
    assert "whole words" in kd.supports(kd.Layout("token", 2), kd.Layout("token", 2), 16,
                                        True, 64, 16)
    with pytest.raises(ValueError, match="stored layout kind 'fp8' is unknown"):
        kd.Layout("fp8")


LLAMA = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=48)  # head dim 32, GQA 2
MPT = jaxllm.ModelConfig.gpt_neox(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                                  rotary_pct=0.0)
MPT = dataclasses.replace(MPT, family="mpt", pos_emb="alibi", norm_bias=False, attn_bias=False,
                          mlp_bias=False, sink="zero")  # ALiBi, softmax-off-by-one
STEPS = {  # model, cache dtype, KV quantization, window
    "llama GQA, bfloat16 (keys stored rotated)": (LLAMA, jnp.bfloat16, None, 13),
    "ALiBi + softmax-off-by-one, int8": (MPT, jnp.float32, kq.KVQuant("int8", 8), 13),
    "KIVI-4, R = 8 not dividing the window 13": (LLAMA, jnp.float32,
                                                kq.KVQuant("kivi", 4, 8, residual=8), 13),
}


@pytest.mark.parametrize("case", STEPS)
def test_decode_steps_through_the_kernel_equal_the_xla_form(case, monkeypatch):
    """Prefill two rows of different lengths, then decode until the 2 + W ring has wrapped: the
    kernel's logits (interpreted) are the XLA form's (jaxllm.attention.decode; KIVI's, which
    reads before it writes: jaxllm.attention.ring), to float32 rounding, for a cache of every
    kind of key (rotated when stored; turned in the kernel: KIVI's; no RoPE, with ALiBi and
    softmax-off-by-one's virtual key folded in beside the kernel). Each format's reading is the
    test above's."""
    cfg, dtype, kvq, window = STEPS[case]
    import pallas_kernels.decode as kernel
    calls = []
    monkeypatch.setattr(kernel, "partials", lambda *a, _f=kernel.partials, **k: (
        calls.append(1), _f(*a, **k))[1])
    params = jaxllm.init_params(cfg, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, window + 11), 0, cfg.vocab_size)

    def run(form):
        c = dataclasses.replace(cfg, kernels=Kernels(attention=form))
        cache = jaxllm.init_cache(c, 2, sinks=2, window=window, dtype=dtype, kv_quant=kvq)
        cache = apply(params, c, toks[:, :15], cache, jnp.array([15, 9], jnp.int32))[1]
        step = jax.jit(lambda cc, t: apply(params, c, t, cc, jnp.ones((2,), jnp.int32)))

        def body(c, t):
            lg, c = step(c, t[:, None])
            return c, lg[:, 0]
        return np.asarray(jax.lax.scan(body, cache, toks[:, 15:].T)[1])  # to wrap past W
    want, got = run("blockwise"), run("pallas")
    assert calls, "the kernel was not used"
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())


SHIPPED = {  # Llama-2-7B at batch 8 (4 + 4092), SmolLM2-135M at batch 1 (4 + 1020)
    "llama2-7b": (8, 32, 1, 128, 4096), "smollm2": (1, 3, 3, 64, 1024)}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("model", SHIPPED)
def test_kernel_lowers_for_gpu_and_tpu_at_shipped_shapes(model, platform):
    """Triton and Mosaic TPU lowering (no device needed) of every format at the shapes we ship,
    including the block and split choices of jaxllm.attention.stored."""
    from jaxllm.attention import stored
    B, KVH, G, D, C = SHIPPED[model]
    N = B * KVH
    S = jax.ShapeDtypeStruct

    def side(lay):
        P = D * lay.bits // 32 if lay.packed else D
        code = {"float": jnp.bfloat16, "int8": jnp.int8}.get(
            lay.kind, jnp.uint32 if lay.packed else jnp.uint8)
        rows = {"int8": 1, "token": D // lay.channel_group(D)}.get(lay.kind, D)
        side = {"int8": 1, "token": 2, "channel": 2}.get(lay.kind, 0)
        n = C // lay.group if lay.kind == "channel" else C
        return (S((N, C, P), code),) + (S((N, n, rows), jnp.float16),) * side
    for kl, vl in [(kd.Layout("float"), kd.Layout("float")),
                   (kd.Layout("int8", 8), kd.Layout("int8", 8)),
                   (kd.Layout("token", 4), kd.Layout("token", 4)),
                   (kd.Layout("channel", 2, 32), kd.Layout("token", 2))]:
        bk = stored.block_for(kl, C)
        splits = max(1, min(C // bk, -(-stored.TARGET_PROGRAMS // N)))
        rotate = kl.kind != "float"

        def f(q, k, v, pick, freq):
            return kd.partials(q, k, v, pick, rope=kd.Rope(freq, -C) if rotate else None,
                               k_layout=kl, v_layout=vl, splits=splits, bk=bk,
                               backend="triton" if platform == "cuda" else "tpu")
        text = jax.jit(f).trace(S((N, 2, G, D), jnp.float32), side(kl), side(vl),
                                S((B, C), jnp.int32), S((B, D // 2), jnp.float32)).lower(
            lowering_platforms=(platform,)).as_text()
        assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text


@pytest.mark.parametrize("kv", ["bfloat16", "int8", "kivi-2"])
def test_decode_step_lowers_for_gpu_with_the_kernel(kv, monkeypatch):
    """A whole decode step of Llama-2-7B shapes (2 layers) on a 4 + 4092 cache at batch 8, as
    benchmarks/gpu_decode.py runs it, lowers for CUDA with the stored-format kernel in it
    (KIVI too: R = 32 does not divide 4092)."""
    cfg = dataclasses.replace(jaxllm.PRESETS["llama2-7b"], num_layers=2,
                              kernels=Kernels(attention="pallas"))
    kvq = {"bfloat16": None, "int8": kq.KVQuant("int8", 8),
           "kivi-2": kq.KVQuant("kivi", 2, 32, residual=32)}[kv]
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, 8, sinks=4, window=4092,
                                                     dtype=jnp.bfloat16, kv_quant=kvq))
    step = jax.jit(lambda p, t, c, n: apply(p, cfg, t, c, n)).trace(
        params, jax.ShapeDtypeStruct((8, 1), jnp.int32), cache,
        jax.ShapeDtypeStruct((8,), jnp.int32))
    text = step.lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text  # (one call: the layers are a scan)


def _llama7b_shapes(batch: int):
    """Llama-2-7B's shapes with 2 layers and the Pallas decode kernel: (cfg, bfloat16 params,
    a bfloat16 4 + 4092 cache of ``batch`` rows), all abstract."""
    cfg = dataclasses.replace(jaxllm.PRESETS["llama2-7b"], num_layers=2,
                              kernels=Kernels(attention="pallas"))
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, batch, sinks=4, window=4092,
                                                     dtype=jnp.bfloat16))
    return cfg, params, cache


def test_a_chats_bursts_lower_for_gpu_with_the_kernel():
    """generate.steps (a chat's answer, a burst a call) lowers for CUDA with the stored-format
    kernel in its loop: Llama-2-7B shapes, 2 layers, a bfloat16 4 + 4092 cache."""
    from jaxllm.generate import SamplingConfig, steps
    cfg, params, cache = _llama7b_shapes(1)
    S = jax.ShapeDtypeStruct
    traced = steps.trace(params, cfg, SamplingConfig().rule, 4, cache, S((1,), jnp.int32),
                         S((), jnp.int32), S((), jnp.int32), jax.random.key(0))
    assert "__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_a_servers_bursts_lower_for_gpu_with_the_kernel():
    """The serving engine's decode call (jaxllm.serve.engine.steps_rows: a burst for every row
    of the pool, each row sampled by its own rule) lowers for CUDA with the stored-format kernel
    in its loop: Llama-2-7B shapes, 2 layers, 8 rows of a bfloat16 4 + 4092 cache."""
    from jaxllm.serve.engine import steps_rows
    cfg, params, cache = _llama7b_shapes(8)
    S = jax.ShapeDtypeStruct
    rows = S((8,), jnp.int32)
    rule = (S((8,), jnp.float32), rows, S((8,), jnp.float32), rows, rows)
    traced = steps_rows.trace(params, cfg, 4, cache, rows, rows, S((), jnp.int32),
                              S((), jnp.int32), rule)
    assert "__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("platform,call", [("cuda", "__gpu$xla.gpu.triton"),
                                           ("tpu", "tpu_custom_call")])
def test_a_chunk_a_layer_at_a_time_lowers_with_the_feeds_kernels(platform, call):
    """The chat's prompt a layer at a time (model.apply_by_layer's layer program) lowers for
    CUDA and TPU with the Pallas kernels that the one-program feed runs per layer: Llama-2-7B
    shapes, 2 layers, a 16-token chunk into a bfloat16 4 + 4092 cache."""
    from jaxllm import model
    from jaxllm.generate import SamplingConfig, feed
    cfg, params, cache = _llama7b_shapes(1)
    S = jax.ShapeDtypeStruct
    tokens, lens = S((1, 16), jnp.int32), S((1,), jnp.int32)
    whole = feed.trace(params, cfg, SamplingConfig().rule, cache, tokens, lens,
                       jax.random.key(0)).lower(lowering_platforms=(platform,)).as_text()
    ends = {k: v for k, v in params.items() if not k.startswith("layer_")}
    view = model.layer_view(cache, 0)
    static = model._plan_static(cfg, (view, lens), 16)
    x, plan = jax.eval_shape(model._embed_jit, ends, cfg, tokens, view, lens)
    one = model._layer_jit.trace(params["layer_0"], cfg, static, x, (cache.k[0], cache.v[0]),
                                 plan).lower(lowering_platforms=(platform,)).as_text()

    def kernels(text):  # each kernel call's attributes (its compiled body) and types
        return {line.split(") {", 1)[1] for line in text.splitlines() if f"@{call}(" in line}
    assert kernels(one) and kernels(one) == kernels(whole)
