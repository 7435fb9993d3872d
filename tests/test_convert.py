"""Converters against transformers itself: random-weight HF models of every family and variant,
converted (from a saved directory, as users do, without torch), must give the same logits and
(one variant per family and each special case) the same 32 greedy tokens; streamed with sinks
they must match transformers recomputing on the kept tokens; the round trip through to_hf must
be exact."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from naive import NaiveStream

torch = pytest.importorskip("torch")
import transformers as tf  # noqa: E402

import convert  # noqa: E402
import jaxllm  # noqa: E402

V = 96
NEOX = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128)
LLAMA = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=96)
# Large init so logits have clear winners: greedy decoding must not hinge on 1e-6 ties.
INIT = dict(initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ROPE3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=16, rope_theta=10000.0)

VARIANTS = {
    "neox-parallel-rot0.25": (tf.GPTNeoXConfig, dict(NEOX, rotary_pct=0.25)),
    "neox-sequential-rot0.5-tied": (tf.GPTNeoXConfig, dict(NEOX, rotary_pct=0.5,
                                                           use_parallel_residual=False,
                                                           tie_word_embeddings=True)),
    "neox-rot1": (tf.GPTNeoXConfig, dict(NEOX, rotary_pct=1.0)),
    "llama-kv1": (tf.LlamaConfig, dict(LLAMA, num_key_value_heads=1)),
    "llama-kv2-tied": (tf.LlamaConfig, dict(LLAMA, num_key_value_heads=2,
                                            tie_word_embeddings=True)),
    "llama-kv4-bias": (tf.LlamaConfig, dict(LLAMA, num_key_value_heads=4, attention_bias=True,
                                            mlp_bias=True)),
    "llama-rope-linear": (tf.LlamaConfig, dict(LLAMA, num_key_value_heads=2, rope_parameters=dict(
        rope_type="linear", factor=2.0, rope_theta=10000.0))),
    "llama-rope-dynamic": (tf.LlamaConfig, dict(LLAMA, num_key_value_heads=2,
                                                max_position_embeddings=16, rope_parameters=dict(
                                                    rope_type="dynamic", factor=2.0,
                                                    rope_theta=10000.0))),
    "llama3-rope": (tf.LlamaConfig, dict(LLAMA, num_key_value_heads=2, rope_parameters=ROPE3)),
    "mistral-window8": (tf.MistralConfig, dict(LLAMA, num_key_value_heads=2, sliding_window=8)),
    "falcon-new-kv2": (tf.FalconConfig, dict(NEOX, new_decoder_architecture=True, num_kv_heads=2,
                                             ffn_hidden_size=128)),
    "falcon-multiquery": (tf.FalconConfig, dict(NEOX, new_decoder_architecture=False,
                                                multi_query=True, parallel_attn=True)),
    "falcon-sequential-bias": (tf.FalconConfig, dict(NEOX, new_decoder_architecture=False,
                                                     multi_query=False, parallel_attn=False,
                                                     bias=True, tie_word_embeddings=False)),
    "mpt-alibi": (tf.MptConfig, dict(vocab_size=V, d_model=64, n_layers=2, n_heads=4)),
    "mpt-6heads-clip": (tf.MptConfig, dict(vocab_size=V, d_model=48, n_layers=2, n_heads=6,
                                           attn_config=dict(clip_qkv=0.4, alibi=True))),
    "opt-prenorm": (tf.OPTConfig, dict(NEOX, ffn_dim=128, do_layer_norm_before=True)),
    "opt-postnorm-project": (tf.OPTConfig, dict(NEOX, ffn_dim=128, do_layer_norm_before=False,
                                                word_embed_proj_dim=32)),
}
STREAMABLE = [k for k in VARIANTS if not k.startswith("opt")]
# 32 greedy tokens against transformers' generate (a compile of jaxllm's generate and a torch
# decode each) for one variant of each family and every special case; the others' cached path
# is checked against transformers by the streaming test below, and their logits here.
GREEDY = {"neox-parallel-rot0.25", "neox-sequential-rot0.5-tied", "llama-kv1",
          "llama-rope-dynamic", "llama3-rope", "mistral-window8", "falcon-new-kv2",
          "mpt-6heads-clip", "opt-prenorm", "opt-postnorm-project"}


def build_hf(name: str, **over):
    cls, kw = VARIANTS[name]
    torch.manual_seed(0)
    kw = {**INIT, **kw, **over}
    model = tf.AutoModelForCausalLM.from_config(cls(**kw), attn_implementation="eager").eval()
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, its saved directory), built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            model = build_hf(name)
            d = tmp_path_factory.mktemp(name)
            model.save_pretrained(d)
            cache[name] = (model, str(d))
        return cache[name]
    return get


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.array(tokens))).logits.float().numpy()


def naive_greedy(params, cfg, prompt, n):
    stream = NaiveStream(params, cfg)
    logits, out = stream.run(prompt)[-1], []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = stream.step(out[-1])
    return np.asarray(out)


TOKENS = np.asarray(jax.random.randint(jax.random.key(1), (2, 24), 0, V))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_greedy_match_transformers(name, saved):
    model, d = saved(name)
    cfg, params = convert.from_hf(d)
    assert cfg.family == model.config.model_type
    ours, _ = jaxllm.forward(params, cfg, TOKENS)
    np.testing.assert_allclose(ours, hf_logits(model, TOKENS), atol=1e-4, rtol=0)
    if name not in GREEDY:
        return

    prompt = TOKENS[:1, :12]
    if "dynamic" in name:
        # Dynamic NTK past the original length has no single transformers answer to match: its
        # cached generate keeps keys rotated with earlier bases, its uncached one recomputes
        # every hidden state. jaxllm caches keys before RoPE and re-rotates them with the current
        # base, so the reference is the naive numpy cache that does exactly that, from formulas.
        ref = naive_greedy(params, cfg, prompt[0], 32)
    else:
        with torch.no_grad():
            ref = model.generate(torch.as_tensor(prompt), max_new_tokens=32,
                                 do_sample=False)[0, 12:].numpy()
    cache = jaxllm.init_cache(cfg, 1, sinks=0, window=44, ring=False)
    res = jaxllm.generate(params, cfg, jnp.asarray(prompt), cache,
                          jaxllm.SamplingConfig(max_new_tokens=32), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(res.tokens[0, :32]), ref)


@pytest.mark.parametrize("name", STREAMABLE)
def test_streaming_one_layer_matches_transformers_recompute(name):
    """One layer: a cached key depends only on its token, so StreamingLLM's logits for token t
    must equal transformers run on [sinks + the last W tokens] at positions 0..n-1
    (docs/METHODS.md §1; for ALiBi that is the contiguous in-cache distance)."""
    model = build_hf(name, **({"n_layers": 1} if "mpt" in name else {"num_hidden_layers": 1}))
    cfg, params = convert.from_hf(model)  # the in-memory path
    S, W, N = 2, 5, 30
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (1, N), 0, V))
    ref = []
    for t in range(N):
        kept = list(range(min(S, t + 1))) + list(range(max(S, t - W + 1), t + 1))
        ref.append(hf_logits(model, tokens[:, kept])[:, -1])
    cache = jaxllm.init_cache(cfg, 1, sinks=S, window=W)
    got = []
    for c in range(0, N, 7):  # chunked prefill across ring wrap-arounds
        logits, cache = jaxllm.forward(params, cfg, tokens[:, c:c + 7], cache)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, 1), np.stack(ref, 1), atol=1e-4, rtol=0)


def test_opt_refuses_to_stream(saved):
    _, d = saved("opt-prenorm")
    cfg, params = convert.from_hf(d)
    with pytest.raises(ValueError, match="learned absolute position"):
        jaxllm.forward(params, cfg, TOKENS, jaxllm.init_cache(cfg, 2, sinks=4, window=60))
    with pytest.raises(ValueError, match="learned positions for 2048"):
        jaxllm.forward(params, cfg, TOKENS, jaxllm.init_cache(cfg, 2, sinks=0, window=4096,
                                                                 ring=False))


@pytest.mark.parametrize("name", ["neox-parallel-rot0.25", "neox-sequential-rot0.5-tied",
                                  "llama-kv2-tied", "llama3-rope", "mistral-window8"])
def test_to_hf_round_trip_is_exact_and_loads_in_transformers(name, saved, tmp_path):
    model, d = saved(name)
    cfg, params = convert.from_hf(d)
    convert.to_hf(cfg, params, str(tmp_path / "out"))
    cfg2, params2 = convert.from_hf(str(tmp_path / "out"))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(model, TOKENS))


def test_trained_here_exports_to_transformers(tmp_path):
    """A jaxllm-native model (our own init, byte vocab) loads in transformers with our logits."""
    for cfg in (jaxllm.PRESETS["pythia-tiny"], jaxllm.PRESETS["llama-tiny"]):
        params = jaxllm.init_params(cfg, jax.random.key(3))
        convert.to_hf(cfg, params, str(tmp_path / cfg.family))
        back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / cfg.family)).eval()
        toks = TOKENS % cfg.vocab_size
        np.testing.assert_allclose(hf_logits(back, toks), jaxllm.forward(params, cfg, toks)[0],
                                   atol=1e-4, rtol=0)


def test_sharded_index_and_bfloat16(tmp_path):
    build_hf("llama-kv2-tied").to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    cfg, params = convert.from_hf(str(tmp_path))
    ref = build_hf("llama-kv2-tied")  # float32 with the weights rounded as the file holds them
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    np.testing.assert_allclose(jaxllm.forward(params, cfg, TOKENS)[0], hf_logits(ref, TOKENS),
                               atol=1e-4, rtol=0)
    # An untrusted index: shard paths leaving the directory, or no weight_map, are refused.
    index = tmp_path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    name = next(iter(meta["weight_map"]))
    meta["weight_map"][name] = "../other/model.safetensors"
    index.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="names shard files outside"):
        convert.from_hf(str(tmp_path))
    index.write_text(json.dumps({"weight_map": 3}))
    with pytest.raises(ValueError, match="has no weight_map"):
        convert.from_hf(str(tmp_path))
    index.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        convert.from_hf(str(tmp_path))


def test_orbax_round_trip_into_a_sharding(saved, tmp_path):
    _, d = saved("falcon-new-kv2")
    cfg, params = convert.from_hf(d)
    jaxllm.save_model(str(tmp_path / "m"), cfg, params, format="orbax")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cfg2, params2, tok = jaxllm.load_model(str(tmp_path / "m"), sharding=sharding)
    assert cfg2 == cfg and isinstance(tok, jaxllm.ByteTokenizer)
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    assert all(x.sharding == sharding for x in jax.tree.leaves(params2))


# ---- errors -------------------------------------------------------------------------------------

def _hf_dir(tmp_path, name="llama-kv2-tied"):
    d = tmp_path / "hf"
    build_hf(name).save_pretrained(d)
    return d


def test_unsupported_model_type_lists_supported(tmp_path):
    d = _hf_dir(tmp_path)
    meta = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(meta, model_type="gpt2")))
    with pytest.raises(convert.UnsupportedModel, match="'gpt2'.*gpt_neox, llama, mistral, falcon"):
        convert.from_hf(str(d))


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _hf_dir(tmp_path)
    w = load_file(str(d / "model.safetensors"))
    w2 = dict(w)
    del w2["model.layers.1.mlp.up_proj.weight"]
    w2["model.layers.1.mlp.surprise"] = np.zeros(3, np.float32)
    save_file(w2, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing: \[model.layers.1.mlp.up_proj.weight\]; "
                                         r"unexpected: \[model.layers.1.mlp.surprise\]"):
        convert.from_hf(str(d))
    w3 = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)})
    save_file(w3, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 64\), but the config "
                                         r"needs \(32, 64\)"):
        convert.from_hf(str(d))


def test_corrupted_safetensors_and_pickle_refusal(tmp_path):
    d = _hf_dir(tmp_path)
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="corrupted"):
        convert.from_hf(str(d))
    os.remove(d / "model.safetensors")
    model = build_hf("llama-kv2-tied")
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        convert.from_hf(str(d))
    cfg, params = convert.from_hf(str(d), allow_pickle=True)
    np.testing.assert_allclose(jaxllm.forward(params, cfg, TOKENS)[0], hf_logits(model, TOKENS),
                               atol=1e-4, rtol=0)


def test_unsupported_export_is_refused():
    cfg = dataclasses.replace(jaxllm.PRESETS["pythia-tiny"], family="opt", pos_emb="learned")
    with pytest.raises(convert.UnsupportedModel, match="export to Hugging Face supports"):
        convert.to_hf(cfg, None, "/nonexistent")


@pytest.mark.parametrize("name", ["neox-sequential-rot0.5-tied", "llama3-rope", "falcon-multiquery",
                                  "mpt-6heads-clip"])
def test_streaming_converted_model_matches_naive_cache(name, saved):
    """Two layers, chunked and padded: StreamingLLM on the converted model against the naive
    numpy list cache (tests/naive.py) that re-positions the kept tokens every step."""
    model, d = saved(name)
    cfg, params = convert.from_hf(d)
    S, W, C = 2, 5, 6
    rng = np.random.default_rng(0)
    cache = jaxllm.init_cache(cfg, 2, sinks=S, window=W)
    streams, got = [[], []], [[], []]
    for _ in range(6):
        lens = rng.integers(0, C + 1, size=2)
        toks = rng.integers(0, V, size=(2, C))
        logits, cache = jaxllm.forward(params, cfg, toks, cache, lens)
        for b in range(2):
            streams[b] += list(toks[b, :lens[b]])
            got[b].append(np.asarray(logits[b, :lens[b]]))
    for b in range(2):
        ref = NaiveStream(params, cfg, S, W).run(streams[b])
        np.testing.assert_allclose(np.concatenate(got[b]), ref, atol=1e-4, rtol=0)


# ---- CLI ----------------------------------------------------------------------------------------

def test_cli_convert_export_and_hf_model_everywhere(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxllm.cli import main
    hf = tmp_path / "hf"
    model = build_hf("neox-parallel-rot0.25")
    model.save_pretrained(hf)
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(V - 2)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(hf)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 90}" for i in range(300)))

    # an HF directory works directly as --model, tokenizer included
    assert main(["ppl", "--model", str(hf), "--text", str(text), "--cache", "64", "--quiet",
                 "--json", str(tmp_path / "a.json")]) == 0
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "jl"), "--quiet"]) == 0
    assert main(["ppl", "--model", str(tmp_path / "jl"), "--text", str(text), "--cache", "64",
                 "--quiet", "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["ppl"] for n in "ab")
    assert a == pytest.approx(b, rel=1e-6)
    assert main(["export-hf", "--model", str(tmp_path / "jl"), "--out", str(tmp_path / "back"),
                 "--quiet"]) == 0
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"),
                                                   attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(model, TOKENS))
    assert tf.AutoTokenizer.from_pretrained(str(tmp_path / "back")).encode("w3 w5") == [5, 7]
    assert main(["generate", "--model", str(tmp_path / "jl"), "--prompt", "w1 w2",
                 "--max-new-tokens", "4", "--cache", "32"]) == 0


def test_plugins_are_found_in_a_checkout_never_installed(monkeypatch, capsys):
    """A source checkout on PYTHONPATH has no installed entry points (the GPU run of
    2026-11-24 lost three tests to it): the convert commands and the Hugging Face reader are
    then read from the checkout's pyproject.toml."""
    import importlib.metadata

    from jaxllm import io
    from jaxllm.cli import main
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    assert [r.name for r in io.plugins(io.READER_GROUP)] == ["GGUF", "Hugging Face"]
    for cmd in ("convert", "export-hf"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0 and f"usage: jaxllm {cmd}" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    from jaxllm.cli import main
    build_hf("opt-prenorm").save_pretrained(tmp_path / "opt")
    assert main(["convert", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["ppl", "--model", str(tmp_path / "opt"), "--quiet"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert main(["export-hf", "--model", str(tmp_path / "opt"), "--out", str(tmp_path / "y")]) == 2
    assert "export to Hugging Face supports gpt_neox, llama, mistral" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


SHARDED_RESTORE = r"""
import os, sys, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxllm
assert len(jax.devices()) == 4
cfg, params, _ = jaxllm.load_model(sys.argv[1])  # unsharded, the reference
mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "fsdp"))
# shard every matrix's first axis over fsdp, replicate vectors
spec = jax.tree.map(lambda a: NamedSharding(mesh, P("fsdp") if a.ndim == 2 else P()), params)
_, sharded, _ = jaxllm.load_model(sys.argv[1], sharding=spec)
emb = sharded["embed"]["embedding"]
assert emb.sharding == spec["embed"]["embedding"], emb.sharding
assert {s.data.shape[0] for s in emb.addressable_shards} == {emb.shape[0] // 2}
jax.tree.map(np.testing.assert_array_equal, sharded, params)
print("ok")
"""


def test_orbax_restores_into_a_multi_device_sharding(tmp_path):
    """Four CPU devices (a fresh process, since the device count is fixed at start-up)."""
    import subprocess
    import sys
    cfg = jaxllm.PRESETS["llama-tiny"]
    jaxllm.save_model(str(tmp_path / "m"), cfg, jaxllm.init_params(cfg, jax.random.key(0)),
                      format="orbax")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", SHARDED_RESTORE, str(tmp_path / "m")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# ---- real checkpoints' config.json files (transformers 4 era, as they sit on the Hub) ----------

PYTHIA_160M = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0,
               "hidden_act": "gelu", "hidden_size": 768, "initializer_range": 0.02,
               "intermediate_size": 3072, "layer_norm_eps": 1e-05,
               "max_position_embeddings": 2048, "model_type": "gpt_neox",
               "num_attention_heads": 12, "num_hidden_layers": 12, "rotary_emb_base": 10000,
               "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
               "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
             "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
             "tie_word_embeddings": False, "vocab_size": 32000}


def test_hub_configs_map_to_the_published_architectures():
    # The presets were written from the papers' tables (docs/METHODS.md §2), independently of
    # the reader.
    assert convert.config_from_hf(PYTHIA_160M) == jaxllm.PRESETS["pythia-160m"]
    assert convert.config_from_hf(LLAMA2_7B) == jaxllm.PRESETS["llama2-7b"]
    llama31 = dict(LLAMA2_7B, num_key_value_heads=8, rope_theta=500000.0, vocab_size=128256,
                   rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192,
                                 "rope_type": "llama3"}, max_position_embeddings=131072)
    cfg = convert.config_from_hf(llama31)
    assert (cfg.num_kv_heads, cfg.rope_theta) == (8, 500000.0)
    assert cfg.rope_scaling == jaxllm.RopeScaling("llama3", 8.0, 8192, 1.0, 4.0)
    falcon7b = {"model_type": "falcon", "alibi": False, "bias": False, "hidden_size": 4544,
                "multi_query": True, "new_decoder_architecture": False,
                "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": True,
                "vocab_size": 65024, "layer_norm_epsilon": 1e-05}
    cfg = convert.config_from_hf(falcon7b)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.shared_norm, cfg.intermediate_size) == (
        1, 64, True, 4 * 4544)
    mpt7b = {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32,
             "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432, "no_bias": True,
             "attn_config": {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None,
                             "qk_ln": False, "softmax_scale": None, "prefix_lm": False}}
    cfg = convert.config_from_hf(mpt7b)
    assert (cfg.pos_emb, cfg.qkv_clip, cfg.norm_bias, cfg.tie_embeddings) == (
        "alibi", 0.0, False, True)
    opt350m = {"model_type": "opt", "hidden_size": 1024, "word_embed_proj_dim": 512,
               "do_layer_norm_before": False, "ffn_dim": 4096, "num_attention_heads": 16,
               "num_hidden_layers": 24, "vocab_size": 50272, "max_position_embeddings": 2048,
               "activation_function": "relu"}
    cfg = convert.config_from_hf(opt350m)
    assert (cfg.embedding_dim, cfg.pre_norm, cfg.final_norm, cfg.mlp) == (512, False, False,
                                                                           "relu")
    with pytest.raises(convert.UnsupportedModel, match="rope scaling 'longrope'"):
        convert.config_from_hf(dict(LLAMA2_7B, rope_scaling={"rope_type": "longrope",
                                                             "factor": 4}))
    with pytest.raises(convert.UnsupportedModel, match="without original_max_position_emb"):
        convert.config_from_hf(dict(LLAMA2_7B, rope_scaling={"rope_type": "yarn", "factor": 4}))
    yarn = convert.config_from_hf(dict(LLAMA2_7B, rope_scaling={
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}))
    assert yarn.rope_scaling == jaxllm.RopeScaling("yarn", 16.0, 4096)
    with pytest.raises(convert.UnsupportedModel, match="Falcon-RW"):
        convert.config_from_hf(dict(falcon7b, alibi=True))


def test_old_checkpoint_names_and_buffers(saved, tmp_path):
    """Pythia files on the Hub say embed_out and carry mask/rotary buffers; OPT files saved from
    OPTModel lack the model. prefix. Both load."""
    from safetensors.numpy import load_file, save_file
    for name, rename in [("neox-parallel-rot0.25", lambda k: k.replace("lm_head.", "embed_out.")),
                         ("opt-postnorm-project", lambda k: k.removeprefix("model."))]:
        model, d = saved(name)
        w = {rename(k): v for k, v in load_file(os.path.join(d, "model.safetensors")).items()}
        if name.startswith("neox"):
            w["gpt_neox.layers.0.attention.bias"] = np.ones((1, 1, 4, 4), np.bool_)
            w["gpt_neox.layers.0.attention.masked_bias"] = np.zeros((), np.float32)
            w["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = np.zeros(2, np.float32)
        out = tmp_path / name
        out.mkdir()
        save_file(w, str(out / "model.safetensors"))
        (out / "config.json").write_text(open(os.path.join(d, "config.json")).read())
        cfg, params = convert.from_hf(str(out))
        np.testing.assert_allclose(jaxllm.forward(params, cfg, TOKENS)[0],
                                   hf_logits(model, TOKENS), atol=1e-4, rtol=0)


def test_out_never_destroys_what_is_there(tmp_path, capsys, monkeypatch):
    """convert / quantize / export-hf refuse an --out whose replacement would lose data: a
    directory of someone's files, the current directory, a file, the source itself (or a path
    around it); a model they wrote before is replaced only with --overwrite; the half-written
    directories of a killed writer are cleaned on the next write."""
    from jaxllm.cli import main
    hf = tmp_path / "hf"
    build_hf("neox-parallel-rot0.25").save_pretrained(hf)
    mine = tmp_path / "thesis"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("do not lose me")
    (mine / "sub" / "data.csv").write_text("1,2,3")
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.chdir(mine)
    hf_files = sorted(os.listdir(hf))
    cases = [(["convert", "--hf", str(hf), "--out", str(mine)], "not written by jaxllm"),
             (["convert", "--hf", str(hf), "--out", "."], "not written by jaxllm"),
             (["convert", "--hf", str(hf), "--out", str(afile)], "not a directory"),
             (["convert", "--hf", str(hf), "--out", str(hf)], "is the input"),
             (["convert", "--hf", str(hf), "--out", str(tmp_path)], "overlaps the input"),
             (["export-hf", "--model", str(hf), "--out", str(hf / "x")], "overlaps the input"),
             (["quantize", "--model", str(hf), "--out", str(hf)], "is the input")]
    for args, msg in cases:
        capsys.readouterr()
        assert main(args + ["--quiet"]) == 2, args
        assert msg in capsys.readouterr().err, args
    assert (mine / "notes.txt").read_text() == "do not lose me"
    assert (mine / "sub" / "data.csv").read_text() == "1,2,3" and afile.read_text() == "x"
    assert sorted(os.listdir(hf)) == hf_files
    # a model written here before: replaced only when asked
    out = tmp_path / "m"
    assert main(["convert", "--hf", str(hf), "--out", str(out), "--quiet"]) == 0
    assert main(["convert", "--hf", str(hf), "--out", str(out), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # a killed writer's half-written directory (pid 2^22 + 1 is not running) goes on next write
    stale = tmp_path / ".m.jaxllm-partial-4194305-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    assert main(["convert", "--hf", str(hf), "--out", str(out), "--quiet", "--overwrite"]) == 0
    assert not stale.exists()
    assert not [n for n in os.listdir(tmp_path) if "jaxllm-partial" in n or "jaxllm-old" in n]
    cfg, _, _ = jaxllm.load_model(str(out))
    assert cfg.family == "gpt_neox"
