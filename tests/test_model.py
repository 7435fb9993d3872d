"""The plain forward and the dense cache against the naive numpy transformer."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA, NEOX
from naive import naive_logits

import jaxllm

VARIANTS = {
    "neox-parallel": NEOX,
    "neox-sequential-rot1.0": dataclasses.replace(NEOX, parallel_residual=False, rotary_pct=1.0),
    "neox-rot0.25": dataclasses.replace(NEOX, hidden_size=64, rotary_pct=0.25),
    "llama-gqa1-tied": dataclasses.replace(LLAMA, num_kv_heads=1, tie_embeddings=True),
    "llama-gqa4-theta": dataclasses.replace(LLAMA, num_kv_heads=4, rope_theta=500000.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_matches_naive_numpy(name):
    cfg = VARIANTS[name]
    params = jaxllm.init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
    logits, cache = jaxllm.forward(params, cfg, tokens)
    assert cache is None and logits.shape == (2, 12, cfg.vocab_size)
    np.testing.assert_allclose(logits, naive_logits(params, cfg, tokens), atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
def test_default_precision_on_gpu_is_within_tf32(model):
    """The tests run float32 products at full precision (conftest); users get the GPU's default,
    TF32 (10-bit mantissa): the forward must still match the float64 reference to TF32's
    rounding, relative to the logits' scale."""
    cfg, params = model
    tokens = jax.random.randint(jax.random.key(5), (2, 24), 0, cfg.vocab_size)
    with jax.default_matmul_precision("default"):
        logits, _ = jax.jit(lambda p, t: jaxllm.model.apply(p, cfg, t))(params,
                                                                                     tokens)
    ref = naive_logits(params, cfg, tokens)
    err = np.abs(np.asarray(logits, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 5e-3, err


def test_dense_cache_decode_equals_plain_forward(model):
    cfg, params = model
    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, cfg.vocab_size)
    full, _ = jaxllm.forward(params, cfg, tokens)
    cache = jaxllm.init_cache(cfg, 2, sinks=0, window=40, ring=False)
    first, cache = jaxllm.forward(params, cfg, tokens[:, :17], cache)  # prefill, then decode
    steps = [first]
    for t in range(17, 40):
        lg, cache = jaxllm.forward(params, cfg, tokens[:, t:t + 1], cache)
        steps.append(lg)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)
    assert list(cache.length) == [40, 40]


def _fed_by_layer_matches_plain_forward(cfg, params):
    tokens = jax.random.randint(jax.random.key(5), (2, 29), 0, cfg.vocab_size)
    full, _ = jaxllm.forward(params, cfg, tokens)
    cache = jaxllm.init_cache(cfg, 2, sinks=0, window=32, ring=False)
    got = []
    for s, e in ((0, 17), (17, 21), (21, 29)):
        lg, cache = jaxllm.model.apply_by_layer(params, cfg, tokens[:, s:e], cache,
                                                np.full((2,), e - s, np.int32))
        got.append(lg)
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, atol=1e-5)
    assert list(cache.length) == [29, 29]


def test_a_layer_at_a_time_equals_the_plain_forward(model):
    """model.apply_by_layer (one program per layer, the chat's and the server's prompt) fed
    chunk after chunk through a dense cache gives the plain forward's logits at every position
    (parallel residual and LayerNorm; GQA and RMSNorm)."""
    _fed_by_layer_matches_plain_forward(*model)


TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=64)
FAMILIES = {"opt-postnorm-project": jaxllm.ModelConfig.of_family("opt", embed_dim=16,
                                                                 pre_norm=False, **TINY),
            "mpt-alibi": jaxllm.ModelConfig.of_family("mpt", **TINY),
            "falcon-shared-norm": jaxllm.ModelConfig.of_family("falcon", shared_norm=True,
                                                               **TINY)}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_at_a_time_in_other_families(family):
    """The same for learned positions with a projection around post-norm blocks (OPT-350m),
    ALiBi (MPT) and a parallel block reading one norm (Falcon-7B)."""
    cfg = FAMILIES[family]
    _fed_by_layer_matches_plain_forward(cfg, jaxllm.init_params(cfg, jax.random.key(1)))


def test_bfloat16_compute_close_to_float32(model):
    cfg, params = model
    tokens = jax.random.randint(jax.random.key(4), (1, 16), 0, cfg.vocab_size)
    ref, _ = jaxllm.forward(params, cfg, tokens)
    lo, _ = jaxllm.forward(params, dataclasses.replace(cfg, dtype="bfloat16"), tokens)
    assert lo.dtype == jnp.float32
    np.testing.assert_allclose(lo, ref, atol=0.05)


def test_config_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        jaxllm.ModelConfig.llama(vocab_size=8, hidden_size=32, num_layers=1, num_heads=4,
                                 num_kv_heads=3, intermediate_size=8)
    with pytest.raises(ValueError, match="unknown family"):
        jaxllm.ModelConfig(family="gpt2", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                           num_kv_heads=1, intermediate_size=8)


def test_a_load_reads_the_weights_a_batch_at_a_time(tmp_path, monkeypatch):
    """A safetensors model's tensors are read into one buffer a batch (asked of the kernel on
    2 MiB pages) and put on the device a batch at a time. Elsewhere than a CPU at most the
    previous batch's host buffer is alive when the next is made (the host copy of the whole
    model never sits beside its device copy); on a CPU the buffers are the device's own, every array inside one (no
    second copy). Sharded and int8 models load as they were saved."""
    import weakref

    import jaxllm.io as io
    from jaxllm import pages
    cfg = dataclasses.replace(LLAMA, hidden_size=128, intermediate_size=512, num_layers=4,
                              vocab_size=512)
    params = jaxllm.init_params(cfg, jax.random.key(1))
    total = sum(x.nbytes for x in jax.tree.leaves(params))  # 4 MiB
    jaxllm.save_model(str(tmp_path / "m"), cfg, params)
    jaxllm.save_model(str(tmp_path / "s"), cfg, params, shard_bytes=total // 3)
    monkeypatch.setattr(io, "_PLACE_BATCH", total // 16)
    made, live_before = [], []

    def recorded(nbytes):
        live_before.append(sum(r() is not None for r in made))
        buf = huge_buffer(nbytes)
        made.append(weakref.ref(buf))
        spans.append((buf.ctypes.data, buf.ctypes.data + buf.nbytes))
        return buf

    huge_buffer = pages.huge_buffer
    monkeypatch.setattr(pages, "huge_buffer", recorded)
    for name in ("m", "s"):
        made.clear(), live_before.clear()
        spans = []
        _, loaded, _ = jaxllm.load_model(str(tmp_path / name))
        jax.tree.map(np.testing.assert_array_equal, params, loaded)
        assert len(made) >= 8, name  # a batch at a time
        if jax.default_backend() == "cpu":  # the buffers read are held as the arrays
            for x in jax.tree.leaves(loaded):
                p = x.unsafe_buffer_pointer()
                assert any(a <= p < b for a, b in spans), name
        else:
            # at most the batch before (its transfer may still be in flight), never the model's
            assert max(live_before) <= 1, (name, live_before)
    if os.path.exists("/proc/self/smaps"):  # each buffer asked for huge pages ("hg")
        buf = huge_buffer(4 << 20)
        start = f"{buf.ctypes.data:x}-"
        smaps = open("/proc/self/smaps").read().split("\n")
        at = next(i for i, line in enumerate(smaps) if line.startswith(start))
        flags = next(line for line in smaps[at:] if line.startswith("VmFlags"))
        assert " hg" in flags, flags
    from jaxllm.smoothquant import quantize_params
    q = quantize_params(params, cfg, "w8")
    jaxllm.save_model(str(tmp_path / "q"), cfg, q)
    jax.tree.map(np.testing.assert_array_equal, q, jaxllm.load_model(str(tmp_path / "q"))[1])


def test_save_load_roundtrip(tmp_path, model):
    cfg, params = model
    jaxllm.save_model(str(tmp_path / "m"), cfg, params)
    with pytest.raises(ValueError, match="overwrite"):  # an earlier model: only when asked
        jaxllm.save_model(str(tmp_path / "m"), cfg, params)
    jaxllm.save_model(str(tmp_path / "m"), cfg, params, overwrite=True)  # swapped atomically
    cfg2, params2, tok = jaxllm.load_model(str(tmp_path / "m"))
    assert cfg2 == cfg and tok.name == "byte"
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    cfg3, shapes, _ = jaxllm.load_model(str(tmp_path / "m"), shapes_only=True)  # data not read
    assert cfg3 == cfg and jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), params)
    assert jaxllm.load_model("random:tiny", shapes_only=True) is None
    bad = dataclasses.replace(cfg, hidden_size=cfg.hidden_size * 2)
    jaxllm.save_model(str(tmp_path / "bad"), bad, params)
    with pytest.raises(ValueError, match="has shape"):
        jaxllm.load_model(str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError, match="no such file or directory; give smollm2"):
        jaxllm.load_model(str(tmp_path / "nope"))
