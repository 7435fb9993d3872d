"""Hostile model files run as a user would meet them: the CLI in a fresh process whose data
segment is bounded (``resource.setrlimit(RLIMIT_DATA)``, 3 GiB: a size that would exhaust
memory fails to allocate instead of swapping the machine), each refused in one line naming the
problem. The files are made here: a one-layer Llama GGUF written with gguf's writer, Hugging
Face and jaxllm directories written by hand. (In-process tests of the same causes, and of
symlinks and chat templates that travel: test_gguf.py, test_nothing_lost.py, test_template.py.)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 3 << 30
TOKENS = ["<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz ") + ["ab"]
V, D, F, H = 32, 64, 128, 4
TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


# The bound is set by the child itself, first thing (a preexec_fn would run in a fork of this
# multithreaded process).
BOUNDED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_DATA, ({0}, {0})); "
           "sys.argv = ['jaxllm'] + sys.argv[1:]; runpy.run_module('jaxllm.cli', "
           "run_name='__main__')").format(LIMIT)


def _cli(args, tmp_path):
    """``jaxllm ARGS`` in a fresh Python with its data segment bounded: (exit status, stderr)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXLLM_CACHE_DIR=str(tmp_path / "cache"))
    # The timeout only stops a hung run; the refusal itself takes seconds.
    p = subprocess.run([sys.executable, "-c", BOUNDED, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stderr.strip()


def _gguf(path, block_count=1, template=TEMPLATE):
    """A one-layer Llama in float32 whose metadata may claim ``block_count`` layers."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(H)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (V - 2))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(template)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,),
              "blk.0.attn_norm.weight": (D,), "blk.0.ffn_norm.weight": (D,),
              "blk.0.attn_q.weight": (D, D), "blk.0.attn_k.weight": (D, D),
              "blk.0.attn_v.weight": (D, D), "blk.0.attn_output.weight": (D, D),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D),
              "blk.0.ffn_down.weight": (D, F)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_gguf_file_fine_as_written_generates(tmp_path):
    """The control: the same file with its true layer count and a sound template runs."""
    rc, err = _cli(["generate", "--model", _gguf(tmp_path / "ok.gguf"), "--prompt", "ab",
                    "--max-new-tokens", "2", "--cache", "16"], tmp_path)
    assert rc == 0, err[-2000:]


@pytest.mark.parametrize("kind", ["gguf", "hf", "jaxllm"])
def test_a_layer_count_of_two_billion_is_one_line(kind, tmp_path):
    """Cause 1: 2,147,483,647 layers claimed by a small file (a MemoryError after minutes, or
    all of RAM, before): refused before anything per layer is built."""
    n = 2 ** 31 - 1
    if kind == "gguf":
        args = ["generate", "--model", _gguf(tmp_path / "m.gguf", block_count=n),
                "--prompt", "ab"]
    else:
        d = tmp_path / "m"
        d.mkdir()
        from safetensors.numpy import save_file
        if kind == "hf":
            cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": D,
                   "num_hidden_layers": n, "num_attention_heads": H, "intermediate_size": F}
            save_file({"model.embed_tokens.weight": np.zeros((V, D), np.float32)},
                      str(d / "model.safetensors"))
            args = ["convert", "--hf", str(d), "--out", str(tmp_path / "out")]
        else:
            import jaxllm
            cfg, params, _ = jaxllm.load_model("embedded")
            jaxllm.save_model(str(d), cfg, params)
            cfg = json.load(open(d / "config.json"))
            cfg["model"]["num_layers"] = n
            args = ["ppl", "--model", str(d), "--max-tokens", "16"]
        (d / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(args, tmp_path)
    assert rc == 2 and "\n" not in err and "2,147,483,647" in err.replace("2147483647",
                                                                          "2,147,483,647"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 2000000000 }}", "{{ lipsum(1000000) }}"])
def test_a_chat_template_without_limits_is_stopped_in_one_line(template, tmp_path):
    """Cause 2: a template that would loop for hours or build gigabytes is stopped by the
    sandbox's bounds, in one line naming the file."""
    path = _gguf(tmp_path / "t.gguf", template=template)
    rc, err = _cli(["generate", "--chat", "--model", path, "--prompt", "hi", "--cache", "16"],
                   tmp_path)
    assert rc == 2 and "\n" not in err and "chat template" in err and "t.gguf" in err, err


@pytest.mark.parametrize("leak", ["model.safetensors", "tokenizer.json"])
def test_files_outside_a_hugging_face_directory_are_not_read(leak, tmp_path):
    """Causes 3 and 4: a weights or tokenizer file that is a symlink out of the directory is
    refused by name before any conversion (no progress bar drawn); nothing is written, so
    nothing of the target is copied out."""
    d, secret = tmp_path / "m", tmp_path / "secret"
    d.mkdir()
    secret.mkdir()
    from safetensors.numpy import save_file
    cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": D, "num_hidden_layers": 1,
           "num_attention_heads": H, "intermediate_size": F}
    (d / "config.json").write_text(json.dumps(cfg))
    target = secret / leak
    if leak == "model.safetensors":
        save_file({"x": np.zeros(1, np.float32)}, str(target))
    else:  # a complete model, so that only its tokenizer is at fault
        shapes = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D),
                  "model.norm.weight": (D,)}
        layer = {"input_layernorm": (D,), "post_attention_layernorm": (D,),
                 "self_attn.q_proj": (D, D), "self_attn.k_proj": (D, D),
                 "self_attn.v_proj": (D, D), "self_attn.o_proj": (D, D),
                 "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}
        shapes.update({f"model.layers.0.{k}.weight": s for k, s in layer.items()})
        save_file({k: np.zeros(s, np.float32) for k, s in shapes.items()},
                  str(d / "model.safetensors"))
        target.write_text('{"private": "not a tokenizer"}')
    os.symlink(target, d / leak)
    rc, err = _cli(["convert", "--hf", str(d), "--out", str(tmp_path / "out")], tmp_path)
    assert rc == 2 and "\n" not in err and f"{leak} leads outside the model directory" in err, err
    assert not (tmp_path / "out").exists()
