"""Bad input and faults (docs/RELIABILITY.md): no silent wrong answers, clear messages naming
the problem and the fix. (--out safety is in test_convert.py; checkpoint fallback and the run
lock in test_train.py.)"""
import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLAMA, NEOX

import jaxllm
from jaxllm.cli import main
from jaxllm.policy import Dense, Recompute, StreamingLLM, Window
from jaxllm.ppl import stream_score

OPT16 = jaxllm.ModelConfig.of_family("opt", vocab_size=64, hidden_size=32, num_layers=1,
                                     num_heads=4, max_seq_len=16)


# ---- silent wrong answers ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 64])
def test_out_of_range_token_ids_are_refused(bad):
    params = jaxllm.init_params(NEOX, jax.random.key(0))
    tokens = np.zeros((2, 5), np.int32)
    tokens[1, 3] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} at row 1, position 3 .*\[0, 64\)"):
        jaxllm.forward(params, NEOX, tokens)
    with pytest.raises(ValueError, match=rf"token id {bad} at row 1, position 3"):
        jaxllm.generate(params, NEOX, tokens, jaxllm.init_cache(NEOX, 2, 2, 14))
    with pytest.raises(ValueError, match="chunk is empty"):
        jaxllm.forward(params, NEOX, np.zeros((1, 0), np.int32))


def test_learned_positions_never_read_past_their_table():
    params = jaxllm.init_params(OPT16, jax.random.key(0))
    text = np.arange(40) % 64
    with pytest.raises(ValueError, match="learned positions for 16 tokens; a dense cache over 40"):
        stream_score(params, OPT16, text, Dense())
    with pytest.raises(ValueError, match="recompute window of 64 exceeds them"):
        stream_score(params, OPT16, text, Recompute(0, 64))
    with pytest.raises(ValueError, match="cannot stream"):
        stream_score(params, OPT16, text, StreamingLLM(4, 12))
    nll, _ = stream_score(params, OPT16, text[:16], Dense())  # within: fine
    assert np.isfinite(nll).all()


def test_kv_cache_takes_float_dtypes_and_integer_sizes():
    for dt in (jnp.int8, jnp.int32, jnp.bool_):
        with pytest.raises(ValueError, match="float dtype"):
            jaxllm.init_cache(NEOX, 1, 2, 6, dtype=dt)
    c = jaxllm.init_cache(NEOX, np.int64(2), np.int32(2), np.int64(6), dtype=jnp.bfloat16)
    assert c.batch == 2 and c.capacity == 8 and c.k[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="batch must be an integer"):
        jaxllm.init_cache(NEOX, 2.0, 2, 6)


def test_integer_tensor_in_a_float_slot_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file
    params = jaxllm.init_params(NEOX, jax.random.key(0))
    d = str(tmp_path / "m")
    jaxllm.save_model(d, NEOX, params)
    flat = load_file(os.path.join(d, "model.safetensors"))
    flat["layer_0/attn/q/kernel"] = flat["layer_0/attn/q/kernel"].astype(np.int8)
    save_file(flat, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="layer_0/attn/q/kernel is int8 where the model needs "
                                         "float weights"):
        jaxllm.load_model(d)


def test_convert_refuses_integer_tensors(tmp_path):
    import torch
    import transformers as tf

    import convert
    torch.manual_seed(0)
    hf = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=64, hidden_size=32,
                                                num_hidden_layers=1, num_attention_heads=4,
                                                intermediate_size=64))
    hf.save_pretrained(tmp_path)
    from safetensors.numpy import load_file, save_file
    path = tmp_path / "model.safetensors"
    flat = load_file(path)
    name = next(k for k in flat if k.endswith("attention.dense.weight"))
    flat[name] = flat[name].astype(np.int8)
    save_file(flat, path)
    with pytest.raises(ValueError, match=f"tensor {name} is int8, not a float tensor"):
        convert.from_hf(str(tmp_path))


def test_non_finite_weights_and_scores_are_reported(tmp_path, capsys):
    params = jaxllm.init_params(NEOX, jax.random.key(0))
    params["layer_1"]["mlp"]["up"]["kernel"] = params["layer_1"]["mlp"]["up"]["kernel"].at[0, 0].set(
        jnp.nan)
    d = str(tmp_path / "nan")
    jaxllm.save_model(d, NEOX, params, tokenizer=None)
    cfg = dataclasses.replace(NEOX, vocab_size=264)  # a byte model, to take text
    params = jaxllm.init_params(cfg, jax.random.key(0))
    params["ln_final"]["scale"] = params["ln_final"]["scale"].at[0].set(jnp.inf)
    d = str(tmp_path / "inf")
    jaxllm.save_model(d, cfg, params)
    assert main(["ppl", "--model", d, "--max-tokens", "40", "--cache", "16", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "tensor ln_final/scale holds NaN or inf" in err and "scores are NaN" in err



@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_host_finiteness_check_finds_nan_and_inf_in_any_slice(dtype, monkeypatch):
    from jaxllm.cli import common
    monkeypatch.setattr(common, "_FINITE_SLICE", 7)  # many slices, the last one short
    x = np.linspace(-3e4, 3e4, 60, dtype=np.float32).astype(jnp.dtype(dtype)).reshape(6, 10)
    assert common._finite(x) and np.isfinite(x.astype(np.float32)).all()
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 31, 59):
            y = x.copy()
            y.flat[at] = bad
            assert not common._finite(y), (bad, at)
            assert not np.isfinite(y.astype(np.float32)).all()

# ---- configs ----------------------------------------------------------------------------------
def test_set_rederives_dependent_fields():
    from train import recipe
    base = recipe("tiny")
    c = recipe("tiny", ["model.hidden_size=128"]).model
    assert (c.head_dim, c.intermediate_size) == (128 // c.num_heads, 512)
    c = recipe("tiny", ["model.num_heads=8"]).model
    assert (c.num_kv_heads, c.head_dim) == (8, base.model.hidden_size // 8)
    c = recipe("tiny", ["model.hidden_size=128", "model.head_dim=16"]).model
    assert c.head_dim == 16  # set by the user: kept
    for bad, msg in [("lr=-1", "lr must be > 0"), ("warmup_frac=2", "warmup_frac must be in"),
                     ("model.num_layers=-1", r"num_layers must be an integer in \[1, "),
                     ("model.vocab_size=-5", r"vocab_size must be an integer in \[1, ")]:
        with pytest.raises(ValueError, match=msg):
            recipe("tiny", [bad])


@pytest.mark.parametrize("field,value,msg", [("num_heads", 0, "num_heads must be an integer in"),
                                             ("num_layers", -1, "num_layers must be an integer in"),
                                             ("vocab_size", -5, "vocab_size must be an integer in")])
def test_non_positive_sizes_name_the_file_and_field(tmp_path, field, value, msg):
    d = str(tmp_path / "m")
    jaxllm.save_model(d, NEOX, jaxllm.init_params(NEOX, jax.random.key(0)))
    meta = json.load(open(os.path.join(d, "config.json")))
    meta["model"][field] = value
    json.dump(meta, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match=f"{d}/config.json: {msg}"):
        jaxllm.load_model(d)
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(NEOX, **{field: value})


def test_hf_config_errors_name_the_file(tmp_path):
    import convert
    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 0, "intermediate_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{tmp_path}: llama config.json has an invalid value"):
        convert.from_hf(str(tmp_path))


def test_invalid_json_config_names_the_file(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model": ')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting value"):
        jaxllm.load_model(str(d))


def test_mpt_alibi_bias_max_follows_transformers():
    import convert
    hf = {"model_type": "mpt", "vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4,
          "attn_config": {"alibi": True, "alibi_bias_max": 4}}
    with pytest.warns(UserWarning, match="alibi_bias_max=4, which transformers ignores"):
        cfg = convert.config_from_hf(hf)
    assert cfg.alibi_bias_max == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default value: no warning
        convert.config_from_hf(dict(hf, attn_config={"alibi": True}))


# ---- resources and arguments ------------------------------------------------------------------
def test_impossible_cache_is_refused_with_its_size(monkeypatch):
    with pytest.raises(ValueError, match=r"needs \d+\.\d GiB .* use a smaller cache"):
        jaxllm.init_cache(LLAMA, 1, 4, 10 ** 9)
    with pytest.raises(ValueError, match="cache must be >= 1"):
        Window(-5)


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt", "x", "--sinks", "100", "--cache", "64"],
     "--cache 64 must exceed --sinks 100"),
    (["eval", "streameval", "--lines", "5"], "--lines must exceed 20"),
    (["eval", "passkey", "--depths", "1.5"], "argument --depths: in '1.5': 1.5 is out of range"),
    (["eval", "passkey", "--lengths", "abc"], "argument --lengths: in 'abc': expected an integer"),
    (["eval", "sinks", "--n", "0"], "argument --n: 0 is out of range: an integer in [1, "),
    (["eval", "sinks", "--seq-len", "0"], "argument --seq-len: 0 is out of range"),
    (["eval", "passkey", "--trials", "0"], "argument --trials: 0 is out of range"),
    (["eval", "outliers", "--alpha", "5"], "--alpha must lie in [0, 1]"),
    (["ppl", "--method", "dense", "--cache", "-3"],
     "argument --cache: -3 is out of range: an integer in [1, 2147483647]"),
    (["generate", "--model", "embedded", "--prompt", "x", "--temperature", "nan"],
     "argument --temperature: nan is out of range: a finite number in [0, inf]"),
    (["generate", "--model", "embedded", "--prompt", "x", "--max-new-tokens",
      "1000000000000"], "argument --max-new-tokens: 1000000000000 is out of range"),
    (["quantize", "--model", "embedded", "--n-seqs", "0", "--out", "q"],
     "argument --n-seqs: 0 is out of range"),
    (["quantize", "--model", "embedded", "--seq-len", "0", "--out", "q"],
     "argument --seq-len: 0 is out of range"),
    (["eval", "sinks", "--model", "embedded", "--keep-quantized"],
     "--keep-quantized applies to GGUF files"),
])
def test_cli_arguments_out_of_range(args, msg, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


def test_seed_past_64_bits_is_an_argument_error(capsys):
    assert main(["generate", "--model", "embedded", "--prompt", "x", "--seed",
                 "1" + "0" * 23]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit in 64 bits" in err[0]


def test_latin1_qa_file_is_named(tmp_path, capsys):
    f = tmp_path / "qa.jsonl"
    f.write_bytes('{"question": "caf\xe9?", "answer": "A"}\n'.encode("latin-1"))
    assert main(["eval", "qa", "--data", str(f), "--model", "random:pythia-tiny", "--out",
                 str(tmp_path / "o"), "--quiet"]) == 2
    assert f"{f} is not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("edit", [lambda e: e.pop("act"), lambda e: e.update(kind="lowbit"),
                                  lambda e: e.clear() or e.update(real=[])])
def test_a_hand_edited_quant_entry_is_one_line(tmp_path, edit):
    """config.json's "quant" entries rebuild the int8 nodes; a damaged one was a KeyError."""
    from jaxllm.quant import decode_weights
    cfg, params, _ = jaxllm.load_model("embedded")
    d = str(tmp_path / "m")
    jaxllm.save_model(d, cfg, decode_weights(params, "float32"))
    meta = json.load(open(os.path.join(d, "config.json")))
    edit(next(iter(meta["quant"].values())))
    json.dump(meta, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError) as e:
        jaxllm.load_model(d)
    msg = str(e.value)  # the entry named, or the tensors it would need
    assert ("field 'quant'" in msg or "does not match its config" in msg) and "\n" not in msg


def test_a_tokenizer_smaller_than_the_vocabulary_is_warned_of(tmp_path, capsys):
    """A tokenizer of another model (256 + 8 byte ids for a 1,024-row model): ids past it print
    as nothing, so loading says so in one line; a padded vocabulary (embedded: 264 = 264) not."""
    from jaxllm.cli.common import load
    cfg, params, _ = jaxllm.load_model("embedded")
    d = str(tmp_path / "m")
    big = dataclasses.replace(cfg, vocab_size=1024)
    jaxllm.save_model(d, big, jaxllm.init_params(big, jax.random.key(0)))
    load(d)
    err = capsys.readouterr().err
    assert "its tokenizer has 264 tokens but the model 1,024" in err and err.count("\n") == 1
    load("embedded")
    assert "tokenizer" not in capsys.readouterr().err


@pytest.mark.parametrize("text", ["[]", '"a string"', '"model_type"', "[1, 2]", "null"])
def test_a_config_that_is_not_an_object_is_one_line(tmp_path, text):
    """config.json holding a list, a string or null (an AttributeError before): one line naming
    the file, from the model loader and from the converter."""
    import convert
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        jaxllm.load_model(str(d))
    assert "config.json is neither a jaxllm config" in str(e.value) and "\n" not in str(e.value)
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(1, np.float32)}, str(d / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        convert.from_hf(str(d))
    assert "config.json" in str(e.value) and "\n" not in str(e.value), str(e.value)
