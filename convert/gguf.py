"""GGUF files (llama.cpp's format) in: the model, its tokenizer and its chat template.

The container is read by :mod:`convert.gguf_file` (memory-mapped, every size checked); the
k-quants (Q4_K, Q5_K, Q6_K) are dequantized by the ``gguf`` package's ``gguf.quants``, the
32-weight block types by :func:`block_codes` here. Each tensor is dequantized at load to float32 (or bfloat16) and
renamed to its Hugging Face name, and the metadata becomes an HF ``config.json`` dict, so the
conversion itself is the Hugging Face one (convert.hf.from_tensors): its name map, shape checks
and family rules. Llama-architecture files (Llama, Mistral-style, SmolLM2) are read; anything
this module does not read (another architecture, rope scaling, ``rope_freqs``, a tensor type) is
refused in one line that names it.

llama.cpp's converter permutes the rows of the query and key projections (it pairs rotary
dimensions (i, i + d/2) as HF's Llama does, but stores them interleaved, (2i, 2i + 1), for its
own RoPE kernel); the permutation is undone here, as transformers' GGUF loader does.

The tokenizer is rebuilt from ``tokenizer.ggml.*`` with the ``tokenizers`` library (no torch):
a byte-level BPE from the file's tokens and merges, split before the merges as llama.cpp does for
the file's ``tokenizer.ggml.pre`` (SmolLM's ``smollm``: every digit apart, then GPT-2's
pattern), its control tokens special, BOS added only where ``add_bos_token`` says so; the chat
template is the file's ``tokenizer.chat_template``, rendered by transformers in its sandboxed
Jinja environment.

``keep_quantized``: the linears stored as Q4_0, Q4_1 or Q8_0 (blocks of 32 weights with a
float16 scale, and Q4_1's float16 minimum), and a tied embedding so stored (the table and the
head), load as jaxllm.lowbit.QLowBit nodes, their codes read from the file's blocks and
repacked, never dequantized: Q4_1 w = d·q + m is scale d,
offset m; Q4_0 w = d·(q - 8) is offset -8d; Q8_0 w = d·q with q int8 is the code q + 128 and
offset -128d, all exact in float32. Other tensors (norms, an untied head) load as float.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.io import ModelReader

# The tensor types read (each checked against transformers' loader in tests/test_gguf.py).
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> the HF Llama name (after "model.layers.N.").
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}

# tokenizer.ggml.pre -> (the splits llama.cpp makes before its word pattern, each piece kept
# apart; whether the word pattern is GPT-2's, which tokenizers' ByteLevel applies itself), from
# llama.cpp's llama-vocab.cpp.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"default": ((), True), "gpt2": ((), True), "gpt-2": ((), True),
              "smollm": ((r"\p{N}",), True), "starcoder": ((r"\p{N}",), True),
              "refact": ((r"\p{N}",), True),
              "llama-bpe": ((_LLAMA3,), False), "llama3": ((_LLAMA3,), False),
              "llama-v3": ((_LLAMA3,), False)}
CONTROL = 3  # tokenizer.ggml.token_type of a control token (<|im_end|>, <|endoftext|>)


def is_gguf(path: str) -> bool:
    """A file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _reader(path: str):
    from .gguf_file import GGUFFile
    return GGUFFile(path)


def _meta(reader) -> dict:
    """Every metadata field's value, except the tokenizer's long arrays (read apart)."""
    return {k: v for k, v in reader.fields.items()
            if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                         "tokenizer.ggml.token_type", "tokenizer.ggml.scores")}


def hf_config(meta: dict, tensor_shapes: dict, where: str) -> dict:
    """The HF ``config.json`` dict of a Llama-architecture file's metadata (``tensor_shapes``:
    name -> numpy-order shape, for what the metadata may leave out)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not read (jaxllm reads "
                         f"{', '.join(ARCHITECTURES)}); convert the original Hugging Face model "
                         f"instead")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    for key in ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
                "expert_count"):
        if g(key) not in (None, 0, "none"):
            raise ValueError(f"{where}: GGUF metadata {arch}.{key} = {g(key)!r} is not read "
                             f"(rope scaling and mixtures of experts); convert the Hugging Face "
                             f"model instead")
    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError(f"{where}: tensor rope_freqs.weight (per-dimension RoPE frequencies, "
                         f"Llama 3.1's scaling) is not read; convert the Hugging Face model "
                         f"instead")
    def count(key, default=None):
        """A positive whole number of the metadata (one for all layers), or ``default``."""
        v = g(key, default)
        if v is None:
            raise ValueError(f"{where}: GGUF metadata {arch}.{key} is missing: not a complete "
                             f"model file")
        if isinstance(v, (list, tuple)):  # per-layer values (e.g. OpenELM's head counts)
            raise ValueError(f"{where}: GGUF metadata {arch}.{key} differs per layer "
                             f"({len(v)} values): jaxllm reads models whose layers are alike")
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{where}: GGUF metadata {arch}.{key} = {v!r} is not a positive "
                             f"whole number: the file is damaged")
        return int(v)

    heads, hidden = count("attention.head_count"), count("embedding_length")
    kv_heads = count("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ValueError(f"{where}: {heads} attention heads cannot share {kv_heads} KV heads "
                         f"evenly: the file's head counts are damaged")
    if g("attention.key_length") is None and hidden % heads:
        raise ValueError(f"{where}: the hidden size {hidden} is not a multiple of the {heads} "
                         f"heads, and {arch}.attention.key_length is missing: damaged metadata")
    head_dim = count("attention.key_length", hidden // heads)
    rot = count("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ValueError(f"{where}: GGUF rope.dimension_count {rot} differs from the head dim "
                         f"{head_dim} (partial rotary): not read for {arch}")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{where}: no token_embd.weight tensor: not a complete model")
    vocab = g("vocab_size") or tensor_shapes["token_embd.weight"][0]
    return {"model_type": "llama", "vocab_size": int(vocab),
            "hidden_size": hidden, "num_hidden_layers": count("block_count"),
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": count("feed_forward_length"), "head_dim": head_dim,
            "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(g("rope.freq_base", 10000.0)), "hidden_act": "silu",
            "max_position_embeddings": int(g("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in tensor_shapes}


def hf_name(name: str) -> Optional[str]:
    """The HF Llama name of a GGUF tensor, or None for one this module does not map."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER and \
            parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's query/key row order: within each head, rows (2i, 2i + 1) go back to
    (i, i + d/2) (w [heads * d, ...], a weight or a bias)."""
    rest = w.shape[1:]
    return w.reshape(heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32, in numpy's order (GGUF lists dimensions fastest first)."""
    kind = tensor.kind
    if kind not in TYPES:
        raise ValueError(f"tensor {tensor.name} is GGUF type {kind}, which is not read "
                         f"(jaxllm reads {', '.join(TYPES)})")
    shape = tensor.shape
    if kind == "F32":
        return tensor.data.view("<f4").reshape(shape)
    if kind == "F16":
        return tensor.data.view("<f2").astype(np.float32).reshape(shape)
    if kind in _BLOCKS:
        codes, scale, offset, _ = block_codes(tensor)
        out, n = shape
        w = codes.reshape(out, n // 32, 32).astype(np.float32)
        w *= scale[..., None]
        w += offset[..., None]
        return w.reshape(shape)
    from gguf import GGMLQuantizationType, quants
    return np.asarray(quants.dequantize(tensor.data, GGMLQuantizationType[kind]),
                      np.float32).reshape(shape)


# Block layouts (bytes per block of 32): a float16 scale d, Q4_1's float16 minimum m, then the
# codes: 16 bytes of nibbles (elements 0-15 low, 16-31 high) or 32 int8.
_BLOCKS = {"Q4_0": (18, False), "Q4_1": (20, True), "Q8_0": (34, False)}
# GGUF linear (after "blk.N.") -> its jaxllm parameter (after "layer_N/").
_LINEARS = {"attn_q": "attn/q", "attn_k": "attn/k", "attn_v": "attn/v", "attn_output": "attn/o",
            "ffn_gate": "mlp/gate", "ffn_up": "mlp/up", "ffn_down": "mlp/down"}


def block_codes(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(codes [out, in] uint8, scale, offset [out, in / 32] float32, bits) of a Q4_0, Q4_1 or
    Q8_0 tensor, read from its blocks: ŵ = code·scale + offset per block of 32."""
    kind = tensor.kind
    size, has_min = _BLOCKS[kind]
    out, n = tensor.shape
    raw = tensor.data.reshape(out, n // 32, size)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = raw[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return q.reshape(out, n).astype(np.uint8), d, -128 * d, 8
    nib = raw[..., 4 if has_min else 2:]
    q = np.concatenate([nib & 0xF, nib >> 4], axis=-1).reshape(out, n)  # 0-15 low, 16-31 high
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8 * d
    return q, d, m, 4


def from_gguf(path: str, *, dtype=np.float32, progress: bool = False,
              keep_quantized: bool = False, reader=None) -> tuple[ModelConfig, dict]:
    """``(cfg, params)`` of a GGUF file, its tensors dequantized to ``dtype``; with
    ``keep_quantized`` its Q4_0/Q4_1/Q8_0 linears as low-bit nodes (the module's note).
    ``reader``: the file already opened (convert.gguf_file.GGUFFile)."""
    from .hf import from_tensors
    path = os.fspath(path)
    reader = reader or _reader(path)
    tensors = reader.tensors
    hf_cfg = hf_config(_meta(reader), {n: t.shape for n, t in tensors.items()}, path)
    unmapped = sorted(n for n in tensors if hf_name(n) is None)
    if unmapped:
        raise ValueError(f"{path}: tensors {', '.join(unmapped[:6])} are not read (not part of "
                         f"a Llama model as jaxllm knows it)")
    by_hf = {hf_name(n): n for n in tensors}
    heads = {"q_proj": hf_cfg["num_attention_heads"], "k_proj": hf_cfg["num_key_value_heads"]}

    kept = set()
    if keep_quantized:  # replaced below by their codes: not dequantized only to be dropped
        kept = {hf_name(n) for n, t in tensors.items() if _kept(n, t, tensors)}

    def get(name: str) -> np.ndarray:
        if name in kept:
            return np.broadcast_to(np.float32(0), tensors[by_hf[name]].shape)
        a = dequantized(tensors[by_hf[name]])
        proj = name.split(".")[-2]
        return unpermute(a, heads[proj]) if proj in heads else a

    # The kept tensors' placeholders are replaced before anything is copied to JAX: filled in
    # as float32 zeros first, SmolLM2's first conversion peaked at 1,178 MiB against 436.
    finish = (lambda flat: _keep_quantized(flat, tensors, heads)) if keep_quantized else None
    return from_tensors(hf_cfg, get, list(by_hf), path, dtype=dtype, progress=progress,
                        finish=finish)


def _kept(name: str, tensor, tensors: dict) -> bool:
    """A tensor ``keep_quantized`` keeps as its blocks: a linear's, or a tied embedding's
    (the table and the head at once; an untied model's embedding and head stay float)."""
    parts = name.split(".")
    return tensor.kind in _BLOCKS and (
        (name == "token_embd.weight" and "output.weight" not in tensors) or
        (len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEARS))


def _keep_quantized(flat: dict, tensors: dict, heads: dict) -> dict:
    """The parameters by path with each kept tensor's placeholder replaced by its blocks."""
    from jaxllm import lowbit
    flat = dict(flat)
    proj = {"attn_q": heads["q_proj"], "attn_k": heads["k_proj"]}
    for name, t in tensors.items():
        if not _kept(name, t, tensors):
            continue
        parts = name.split(".")
        *arrays, bits = block_codes(t)
        if parts[2:3] and parts[2] in proj:  # llama.cpp's query/key row order, undone by rows
            arrays = [unpermute(a, proj[parts[2]]) for a in arrays]
        codes, scale, offset = arrays
        # The file's scales are float16, and so are its offsets where exact (Q4_1's minimum
        # always; -8d and -128d unless they overflow float16): the file's bytes.
        half = [a.astype(np.float16) for a in (scale, offset)]
        if all(np.array_equal(h.astype(np.float32), a) for h, a in zip(half, (scale, offset))):
            scale, offset = half
        node = lowbit.encode(codes, scale, offset, bits, 32)
        if name == "token_embd.weight":
            flat["embed/embedding"] = node
        else:
            flat[f"layer_{parts[1]}/{_LINEARS[parts[2]]}/kernel"] = node
    return flat


def _strings(reader, key: str) -> list[str]:
    v = reader.fields.get(key, [])
    return v if isinstance(v, list) else []


def _tokenizer_parts(path: str, reader):
    """(the ``tokenizers.Tokenizer``, transformers' special-token arguments, the control tokens,
    the chat template) of the file's metadata."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    meta = _meta(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not read (jaxllm reads byte-level "
                         f"BPE, tokenizer.ggml.model 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise ValueError(f"{path}: tokenizer pre-split {pre!r} is not read (jaxllm reads "
                         f"{', '.join(sorted(PRE_SPLITS))})")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    for i, m in enumerate(merges):  # tokenizers would raise without saying which entry
        if len(m) != 2 or m[0] not in vocab or m[1] not in vocab or m[0] + m[1] not in vocab:
            raise ValueError(f"{path}: tokenizer.ggml.merges entry {i} {' '.join(m)!r} is not "
                             f"two of the file's tokens, separated by a space, whose join is one "
                             f"too: the tokenizer is damaged")
    types = reader.fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    core = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    splits, gpt2_words = PRE_SPLITS[pre]
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_words)])
    core.decoder = decoders.ByteLevel()
    special = lambda key: (tokens[int(meta[key])] if key in meta  # noqa: E731
                           and 0 <= int(meta[key]) < len(tokens) else None)
    named = {"bos_token": special("tokenizer.ggml.bos_token_id"),
             "eos_token": special("tokenizer.ggml.eos_token_id"),
             "unk_token": special("tokenizer.ggml.unknown_token_id"),
             "pad_token": special("tokenizer.ggml.padding_token_id")}
    control = [t for t, kind in zip(tokens, types) if int(kind) == CONTROL]
    return core, named, control, meta.get("tokenizer.chat_template"), \
        bool(meta.get("tokenizer.ggml.add_bos_token", False))


def tokenizer_from_gguf(path: str, reader=None):
    """The file's tokenizer and chat template, as a ``transformers.PreTrainedTokenizerFast``
    (built with ``tokenizers``; transformers' own GGUF tokenizer path needs torch)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    core, named, control, template, add_bos = _tokenizer_parts(path, reader or _reader(path))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, chat_template=template,
                                  clean_up_tokenization_spaces=False, **named)
    if control:
        tok.add_special_tokens({"additional_special_tokens": control})
    if add_bos and tok.bos_token:
        # what llama.cpp does for such a file: BOS before every text encoded with special tokens
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B",
            special_tokens=[(tok.bos_token, tok.bos_token_id)])
    return tok


def gguf_tokenizer(path: str, reader=None):
    """The file's tokenizer as jaxllm's Tokenizer (jaxllm.tokenizer.HFTokenizer) over the
    ``tokenizers`` object itself; :func:`tokenizer_from_gguf`'s transformers tokenizer is made
    only if it is asked for (to save it)."""
    from jaxllm.tokenizer import HFTokenizer
    path = os.path.abspath(path)
    reader = reader or _reader(path)
    core, named, control, template, _ = _tokenizer_parts(path, reader)
    specials = [t for t in named.values() if t is not None]
    core.add_special_tokens(specials + [t for t in control if t not in specials])
    special_map = {k: v for k, v in named.items() if v is not None}
    return HFTokenizer.of_backend(core, path, special_map, template,
                                  lambda: tokenizer_from_gguf(path, reader))


def load(path: str, keep_quantized: bool = False):
    """The reader's load: ``(cfg, params, tokenizer)``, the file opened once, or its conversion
    read back from the user's cache (convert.converted) when one was kept."""
    from . import converted
    where = converted.entry(path, keep_quantized)
    hit = where and converted.read(where, path, lambda: tokenizer_from_gguf(path))
    if hit:
        return hit
    reader = _reader(path)
    cfg, params = from_gguf(path, keep_quantized=keep_quantized, reader=reader)
    tok = gguf_tokenizer(path, reader)
    if where:
        converted.write(where, cfg, params, tok)
    return cfg, params, tok


def shapes(path: str, keep_quantized: bool = False):
    """The reader's shapes (jaxllm.io.ModelReader): load's result with the parameters as
    jax.ShapeDtypeStruct leaves, from the conversion kept in the user's cache; None before the
    file's first load has kept one."""
    from . import converted
    where = converted.entry(path, keep_quantized)
    return where and converted.read(where, path, lambda: tokenizer_from_gguf(path),
                                    shapes_only=True)


# What lets jaxllm.load_model read a GGUF file: registered under the "jaxllm.model_readers"
# entry point (pyproject.toml), beside the Hugging Face reader.
READER = ModelReader(name="GGUF", detect=is_gguf, load=load, shapes=shapes)
