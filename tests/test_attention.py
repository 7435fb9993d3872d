"""Blockwise attention (jaxllm.attention.flash) against the materialised scores it replaced:
the core on random segments at odd sizes, then whole models (every position scheme, GQA, the
sink variants, a sliding window) through a plain forward and through sink + ring caches; and
XLA's own accounting that its temporaries grow linearly, not quadratically, with the prompt."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA, NEOX

import jaxllm
from jaxllm.attention import flash
from jaxllm.config import Kernels
from jaxllm.model import apply, stack_layers

MPT = dataclasses.replace(NEOX, family="mpt", pos_emb="alibi", norm_bias=False, attn_bias=False,
                          mlp_bias=False, rotary_pct=0.0)
CFGS = {
    "neox (partial rotary)": NEOX,
    "llama (GQA)": LLAMA,
    "mpt (ALiBi)": MPT,
    "softmax-off-by-one": dataclasses.replace(LLAMA, sink="zero"),
    "learnable sink": dataclasses.replace(LLAMA, sink="learnable"),
    "mistral window 5": dataclasses.replace(LLAMA, sliding_window=5),
    "yarn": dataclasses.replace(LLAMA, rope_scaling=jaxllm.config.RopeScaling(
        "yarn", 4.0, original_max_len=8)),
}


def _segment(rng, B, T, H, KVH, Dh, L, span, shift):
    """Random queries and keys; queries at positions shift..shift+T-1, keys at 0..L-1, a tenth
    of the keys missing."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 2, jnp.float32)
    return flash.Segment(f(B, T, H, Dh), f(B, KVH, L, Dh), f(B, KVH, L, Dh),
                         jnp.broadcast_to(jnp.arange(T) + shift, (B, T)),
                         jnp.broadcast_to(jnp.arange(L), (B, L)),
                         jnp.asarray(rng.random((B, L)) > 0.1), span)


@pytest.mark.parametrize("B,T,H,KVH,Dh,L,span", [
    (2, 37, 4, 2, 8, 53, None),  # T, L not multiples of the block; GQA
    (1, 5, 3, 1, 4, 5, 3),  # one block; a window
    (2, 70, 4, 4, 8, 41, 20),  # more queries than keys
    (1, 1, 2, 2, 8, 29, None),  # a single query
])
@pytest.mark.parametrize("zero_sink", [False, True])
@pytest.mark.parametrize("alibi", [False, True])
def test_blockwise_is_the_materialised_softmax(B, T, H, KVH, Dh, L, span, zero_sink, alibi):
    """Two segments with different queries and positions (as sinks and ring are), in blocks
    of 8 x 8 (conftest): the same output as one softmax over the concatenated [T, L] scores,
    written here with numpy in float64. Rows that see no key at all (the first queries
    against a sparse segment) get the reference's uniform average, not NaN."""
    rng = np.random.default_rng(T * L)
    segs = [_segment(rng, B, T, H, KVH, Dh, L, span, L - T),
            _segment(rng, B, T, H, KVH, Dh, 7, None, 3)]
    slopes = jnp.linspace(0.05, 0.5, H) if alibi else None
    got, _ = flash.attend(segs, slopes, zero_sink, "blockwise")
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(segs, slopes, zero_sink),
                               atol=2e-5, rtol=1e-5)


def _numpy_attention(segs, slopes, zero_sink, xp=np, dtype=np.float64):
    """Softmax attention over the concatenated segments, from the definition, in float64 (or,
    with ``xp=jnp``, in float32 and differentiable: the gradients' oracle)."""
    B, T, H, Dh = segs[0].q.shape
    KVH = segs[0].k.shape[1]
    G = H // KVH
    scores, values = [], []
    for s in segs:
        q = xp.asarray(s.q, dtype).reshape(B, T, KVH, G, Dh)
        k = xp.asarray(s.k, dtype)
        sc = xp.einsum("btkgd,bksd->bkgts", q, k) / math.sqrt(Dh)
        dist = np.asarray(s.q_pos)[:, :, None] - np.asarray(s.k_pos)[:, None, :]
        if slopes is not None:
            sc = sc - np.asarray(slopes).reshape(1, KVH, G, 1, 1) * dist[:, None, None]
        ok = np.asarray(s.k_ok)[:, None, :] & (dist >= 0)
        if s.span is not None:
            ok = ok & (dist < s.span)
        scores.append(xp.where(ok[:, None, None], sc, -1e30))
        values.append(xp.asarray(s.v, dtype))
    sc = xp.concatenate(scores, -1)
    if zero_sink:
        sc = xp.concatenate([xp.zeros_like(sc[..., :1]), sc], -1)
    p = xp.exp(sc - sc.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., int(zero_sink):]
    return xp.einsum("bkgts,bksd->btkgd", p, xp.concatenate(values, 2)).reshape(B, T, H, Dh)


@pytest.mark.parametrize("backend,blocks", [("triton", (16, 16)), ("tpu", (8, 128))])
@pytest.mark.parametrize("B,T,H,KVH,Dh,L,span", [(2, 37, 4, 2, 8, 53, 20),
                                                 (1, 1, 2, 1, 8, 29, None)])
def test_kernel_in_interpret_mode(backend, blocks, B, T, H, KVH, Dh, L, span):
    """The Pallas kernel, both lowerings (Triton's program per query block looping over keys;
    Mosaic TPU's key-block grid axis with the state in scratch), segment after segment through
    one state, ALiBi and softmax-off-by-one on: the attention of the definition. Sizes cross
    several blocks, padded (T, L not multiples of the blocks)."""
    from pallas_kernels import flash as kernel
    rng = np.random.default_rng(L)
    segs = [_segment(rng, B, T, H, KVH, Dh, L, span, L - T),
            _segment(rng, B, T, H, KVH, Dh, 7, None, 3)]
    slopes = jnp.linspace(0.05, 0.5, H)
    m, l, acc = (jnp.moveaxis(a, 1, 2) for a in flash.init_state(B, T, H, Dh, True))
    for seg in segs:
        m, l, acc = kernel.flash_segment(m, l, acc, jnp.moveaxis(seg.q, 1, 2), seg.k, seg.v,
                                         seg.q_pos, seg.k_pos, seg.k_ok, slopes, span=seg.span,
                                         backend=backend, blocks=kernel.Blocks(*blocks),
                                         interpret=True)
    got = jnp.moveaxis(acc / l[..., None], 1, 2)
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(segs, slopes, True), atol=2e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("form", ["blockwise", "pallas"])
def test_gradient_is_the_definitions(form):
    """Training differentiates through the blocks (checkpointed: the scores are recomputed,
    not kept; the Pallas form takes the blockwise gradient): with a window, missing keys,
    ALiBi and softmax-off-by-one, the gradients of jax.grad over the definition written with
    jnp in the test."""
    rng = np.random.default_rng(0)
    seg = _segment(rng, 2, 37, 4, 2, 8, 37, 20, 0)
    slopes = jnp.linspace(0.05, 0.5, 4)
    w = jnp.asarray(rng.standard_normal((2, 37, 4, 8)), jnp.float32)

    def loss(by_definition, q, k, v):
        s = seg._replace(q=q, k=k, v=v)
        out = _numpy_attention([s], slopes, True, jnp, jnp.float32) if by_definition else \
            flash.attend([s], slopes, True, form)[0]
        return jnp.sum(out * w)
    got = jax.grad(functools.partial(loss, False), (0, 1, 2))(seg.q, seg.k, seg.v)
    want = jax.grad(functools.partial(loss, True), (0, 1, 2))(seg.q, seg.k, seg.v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=3e-5, rtol=1e-5)


def _logits(cfg, params, form, monkeypatch, tokens, cache=None, lens=None):
    """Logits (and the cache) of ``apply`` with attention in ``form`` (the config's kernels)."""
    cfg = dataclasses.replace(cfg, kernels=Kernels(attention=form))
    return jax.jit(functools.partial(apply, cfg=cfg))(params, tokens=tokens, cache=cache,
                                                      lens=lens)


@pytest.mark.parametrize("name", list(CFGS))
def test_model_logits_blockwise_equal_materialised(name, monkeypatch):
    """A plain forward of 37 tokens, then a stream through a 3+10 cache (and, for llama, a
    0+13 window): a chunk of 5, then one of 29 padded to 17 in one row, past a ring wrap.
    Blockwise attention (and for llama the Pallas kernel, interpreted) gives the materialised
    form's logits, and the same caches (to rounding: a
    layer's keys come from the attention output of the layer below)."""
    cfg = CFGS[name]
    params = jaxllm.init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 37), 0, cfg.vocab_size)
    if cfg.sink == "learnable":
        tokens = tokens.at[:, 0].set(cfg.sink_id)
    forms = ("blockwise", "materialised") + (("pallas",) if name == "llama (GQA)" else ())
    outs = {f: _logits(cfg, params, f, monkeypatch, tokens)[0] for f in forms}
    for form in forms[:1] + forms[2:]:
        np.testing.assert_allclose(outs[form], outs["materialised"], atol=2e-5, rtol=1e-5)
    if name in ("neox (partial rotary)", "learnable sink", "yarn"):
        return  # their cache streams are the llama case's with other positions: tests/test_cache
    for S, W in ((0, 13), (3, 10)) if name == "llama (GQA)" else ((3, 10),):
        runs = {}
        for form in forms if S else forms[:2]:
            cache = jaxllm.init_cache(cfg, 2, sinks=S, window=W)
            first, cache = _logits(cfg, params, form, monkeypatch, tokens[:, :5], cache,
                                   jnp.asarray([5, 5], jnp.int32))
            second, cache = _logits(cfg, params, form, monkeypatch, tokens[:, 5:34], cache,
                                    jnp.asarray([29, 17], jnp.int32))
            runs[form] = (first, second[:1], second[1:, :17], cache)
        for form in runs:
            for got, want in zip(runs[form][:3], runs["materialised"][:3]):
                np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5,
                                           err_msg=f"{form}, {S}+{W}")
            for got, want in zip(jax.tree.leaves(runs[form][3]),
                                 jax.tree.leaves(runs["materialised"][3])):
                np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("form,bound", [("blockwise", 4.6), ("materialised", None)])
def test_temporaries_grow_linearly_with_the_prompt(form, bound, monkeypatch):
    """XLA's compile-time accounting (abstract arrays, nothing allocated) of a plain forward,
    of its gradient (training's) and of a prefill through a StreamingLLM cache, at T and 4T
    tokens, blocks of
    blocks of 2^14 scores: blockwise, 4x the tokens take at most about 4x the temporaries;
    the materialised scores take about 16x, and 6x through the cache, T x (S + W + T) with a
    window of 4T (the check that the measurement sees the quadratic term)."""
    monkeypatch.setattr(flash, "SCORE_BLOCK_ELEMENTS", 1 << 14)
    cfg = dataclasses.replace(LLAMA, num_layers=1, hidden_size=64, num_heads=8, num_kv_heads=2,
                              vocab_size=32, kernels=Kernels(attention=form))
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))
    B, T = 2, 256
    toks = lambda t: jax.ShapeDtypeStruct((B, t), jnp.int32)
    plain = [_temp_bytes(lambda p, x: apply(p, cfg, x)[0], params, toks(t)) for t in (T, 4 * T)]
    loss = lambda p, x: apply(p, cfg, x)[0].mean()  # noqa: E731
    grad = [_temp_bytes(jax.grad(loss), params, toks(t)) for t in (T, 4 * T)]
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, B, sinks=4, window=4 * T))
    lens = jax.ShapeDtypeStruct((B,), jnp.int32)
    prefill = [_temp_bytes(lambda p, x, c, n: apply(p, cfg, x, c, n, last_only=True)[0],
                           params, toks(t), cache, lens) for t in (T, 4 * T)]
    if bound is None:  # T x T, and T x (S + W + T) with W = 4T
        assert plain[1] / plain[0] > 10 and prefill[1] / prefill[0] > 5, (plain, prefill)
        assert grad[1] / grad[0] > 10, grad
    else:
        assert plain[1] / plain[0] < bound, plain
        assert prefill[1] / prefill[0] < bound, prefill
        assert grad[1] / grad[0] < bound, grad


SMOLLM2 = jaxllm.ModelConfig.llama(vocab_size=49152, hidden_size=576, num_layers=2, num_heads=9,
                                   num_kv_heads=3, intermediate_size=1536, tie_embeddings=True)


@pytest.mark.parametrize("platform,call", [("cuda", "__gpu$xla.gpu.triton"),
                                           ("tpu", "tpu_custom_call")])
@pytest.mark.parametrize("preset", ["llama2-7b", "smollm2"])
def test_prefill_and_training_step_lower_for_gpu_and_tpu(platform, call, preset, monkeypatch):
    """On this CPU, jax lowers for other platforms without a device, through Pallas' Triton
    and Mosaic TPU lowerings (which refuse what the device would: block shapes, dtypes).
    A prefill of 512 tokens through a bfloat16 StreamingLLM 4+4092 cache and a training
    step's gradient (unrolled, and scanned over stacked layers with remat), at Llama-2-7B (2
    layers) and SmolLM2-135M shapes, lower with the attention kernel in them."""
    cfg = dataclasses.replace(jaxllm.PRESETS["llama2-7b"], num_layers=2) \
        if preset == "llama2-7b" else SMOLLM2
    cfg = dataclasses.replace(cfg, kernels=Kernels(attention="pallas"))
    params = jax.eval_shape(lambda k: jaxllm.init_params(cfg, k), jax.random.key(0))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    cache = jax.eval_shape(lambda: jaxllm.init_cache(cfg, 1, sinks=4, window=4092,
                                                     dtype=jnp.bfloat16))
    toks = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    prefill = jax.jit(functools.partial(apply, cfg=cfg, last_only=True)).trace(
        params, tokens=toks, cache=cache, lens=jax.ShapeDtypeStruct((1,), jnp.int32))
    grad = jax.jit(jax.grad(lambda p, x: apply(p, cfg, x)[0].mean())).trace(params, toks)
    # the blocks stacked and scanned, each recomputed in the backward pass (train's scan_layers)
    remat = dataclasses.replace(cfg, remat=True)
    scanned = jax.jit(jax.grad(lambda p, x: apply(p, remat, x)[0].mean())).trace(
        jax.eval_shape(stack_layers, params), toks)
    for traced in (prefill, grad, scanned):
        assert call in traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_is_the_definition(dtype):
    """The compiled Triton kernel (not interpreted), GQA, ALiBi, a window, odd sizes: the
    attention of the definition, to the operands' rounding."""
    from pallas_kernels import flash as kernel
    rng = np.random.default_rng(7)
    B, T, H, KVH, Dh, L = 2, 300, 8, 2, 128, 700
    seg = _segment(rng, B, T, H, KVH, Dh, L, 500, L - T)
    seg = seg._replace(q=seg.q.astype(dtype), k=seg.k.astype(dtype), v=seg.v.astype(dtype))
    slopes = jnp.linspace(0.01, 0.1, H)
    m, l, acc = (jnp.moveaxis(a, 1, 2) for a in flash.init_state(B, T, H, Dh, False))
    m, l, acc = kernel.flash_segment(m, l, acc, jnp.moveaxis(seg.q, 1, 2), seg.k, seg.v,
                                     seg.q_pos, seg.k_pos, seg.k_ok, slopes, span=seg.span)
    got = jnp.moveaxis(acc / l[..., None], 1, 2)
    want = _numpy_attention([seg._replace(q=seg.q.astype(jnp.float32),
                                          k=seg.k.astype(jnp.float32),
                                          v=seg.v.astype(jnp.float32))], slopes, False)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_prefill_of_8_x_2048_at_7b_shapes_runs():
    """The prompt that ran out of memory on an H100 (8 x 2,048 tokens through a 4+4092
    bfloat16 cache, Llama-2-7B layer shapes, here 2 layers and random weights): it runs, by
    the Pallas kernel, and its logits are finite."""
    cfg = dataclasses.replace(jaxllm.PRESETS["llama2-7b"], num_layers=2, dtype="bfloat16")
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                          jaxllm.init_params(cfg, jax.random.key(0)))
    cache = jaxllm.init_cache(cfg, 8, sinks=4, window=4092, dtype=jnp.bfloat16)
    toks = jax.random.randint(jax.random.key(1), (8, 2048), 0, cfg.vocab_size)
    logits, cache = jax.jit(functools.partial(apply, cfg=cfg, last_only=True))(
        params, tokens=toks, cache=cache, lens=jnp.full((8,), 2048, jnp.int32))
    assert logits.shape == (8, 1, cfg.vocab_size) and bool(jnp.isfinite(logits).all())


def test_the_kernel_is_chosen_by_argument_for_each_program():
    """One jitted function (forward's), configs that differ only in their kernels: each call
    gets its own program, the Pallas one with the kernel in it and the one after without it,
    with no environment variable set and no cache cleared in between."""
    from jaxllm.model import _forward_jit
    params = jax.eval_shape(lambda k: jaxllm.init_params(LLAMA, k), jax.random.key(0))
    toks = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    found = []
    for form in ("blockwise", "pallas", "blockwise"):
        cfg = dataclasses.replace(LLAMA, kernels=Kernels(attention=form))
        text = _forward_jit.trace(params, cfg=cfg, tokens=toks).lower(
            lowering_platforms=("cuda",)).as_text()
        found.append("__gpu$xla.gpu.triton" in text)
    assert found == [False, True, False]
