"""Per-family tables between Hugging Face and jaxllm: config fields and tensor names.

Each family has a config reader (HF ``config.json`` dict -> :class:`jaxllm.ModelConfig`) and a name
map (``ModelConfig`` -> list of :class:`Entry`): one HF tensor, its expected shape, the jaxllm
parameters it becomes and the two exact transforms between them. The same table drives import
and export, so a round trip is exact by construction and checked by a test.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import numpy as np

from jaxllm.config import ModelConfig, RopeScaling

SUPPORTED = ("gpt_neox", "llama", "mistral", "falcon", "mpt", "opt")
EXPORTABLE = ("gpt_neox", "llama", "mistral")


class UnsupportedModel(ValueError):
    """The checkpoint uses an architecture or option jaxllm does not implement."""


# ---- config readers -----------------------------------------------------------------------------

_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
         "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "swiglu", "swish": "swiglu"}


def _act(name: str, model_type: str, gated: bool) -> str:
    act = _ACTS.get(name)
    if act is None or (act == "swiglu") != gated:
        raise UnsupportedModel(f"{model_type}: activation {name!r} is not supported here "
                               f"(supported: {', '.join(sorted(_ACTS))})")
    return act


def _rope(hf: dict, default_pct: float = 1.0) -> dict:
    """rope_theta, rotary_pct and rope_scaling from either config generation: transformers 5's
    ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``/``rotary_pct`` keys."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    pct = params.get("partial_rotary_factor",
                     hf.get("partial_rotary_factor", hf.get("rotary_pct", default_pct)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = RopeScaling("linear", float(params["factor"]))
    elif kind == "dynamic":  # transformers measures growth against max_position_embeddings
        scaling = RopeScaling("dynamic", float(params["factor"]),
                              original_max_len=int(hf["max_position_embeddings"]))
    elif kind == "llama3":
        scaling = RopeScaling("llama3", float(params["factor"]),
                              original_max_len=int(params["original_max_position_embeddings"]),
                              low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]))
    elif kind == "yarn":
        if "original_max_position_embeddings" not in params:
            raise UnsupportedModel("yarn rope scaling without original_max_position_embeddings: "
                                   "YaRN's ramp is measured from the original context length")
        factor = params.get("factor") or (hf["max_position_embeddings"]
                                          / params["original_max_position_embeddings"])
        if params.get("mscale") or params.get("mscale_all_dim") or \
                params.get("truncate", True) is False:
            raise UnsupportedModel("yarn with mscale/mscale_all_dim/truncate=False (DeepSeek's "
                                   "variants) is not supported")
        af = params.get("attention_factor")
        scaling = RopeScaling("ntk-by-parts" if af == 1.0 else "yarn", float(factor),
                              original_max_len=int(params["original_max_position_embeddings"]),
                              beta_fast=float(params.get("beta_fast") or 32),
                              beta_slow=float(params.get("beta_slow") or 1),
                              attention_factor=None if af is None else float(af))
    else:
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported; supported: linear, "
                               f"dynamic, llama3, yarn")
    return dict(rope_theta=float(theta), rotary_pct=float(pct), rope_scaling=scaling)


def _neox_config(hf: dict) -> ModelConfig:
    return ModelConfig.of_family(
        "gpt_neox", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], norm_eps=hf.get("layer_norm_eps", 1e-5),
        mlp=_act(hf.get("hidden_act", "gelu"), "gpt_neox", gated=False),
        attn_bias=hf.get("attention_bias", True), mlp_bias=True,
        parallel_residual=hf.get("use_parallel_residual", True),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_seq_len=hf.get("max_position_embeddings", 2048), **_rope(hf, default_pct=0.25))


def _llama_config(hf: dict) -> ModelConfig:
    mt = hf["model_type"]
    return ModelConfig.of_family(
        mt, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], head_dim=hf.get("head_dim") or 0,
        norm_eps=hf.get("rms_norm_eps", 1e-6), mlp=_act(hf.get("hidden_act", "silu"), mt, True),
        attn_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
        sliding_window=(hf.get("sliding_window") or 0) if mt == "mistral" else 0,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_seq_len=hf.get("max_position_embeddings", 2048), **_rope(hf))


def _falcon_config(hf: dict) -> ModelConfig:
    if hf.get("alibi"):
        raise UnsupportedModel("falcon with alibi=True (the Falcon-RW models) is not supported; "
                               "jaxllm supports the rotary Falcon models (7B/40B/180B and small "
                               "configs of them)")
    new = hf.get("new_decoder_architecture", False)
    heads = hf["num_attention_heads"]
    kv = (hf.get("num_kv_heads") or heads) if new else (1 if hf.get("multi_query", True) else heads)
    parallel = new or hf.get("parallel_attn", True)
    n_ln = hf.get("num_ln_in_parallel_attn") or (2 if new else 1)
    return ModelConfig.of_family(
        "falcon", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=kv,
        intermediate_size=hf.get("ffn_hidden_size") or 4 * hf["hidden_size"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        mlp=_act(hf.get("activation", "gelu"), "falcon", gated=False),
        attn_bias=hf.get("bias", False), mlp_bias=hf.get("bias", False),
        parallel_residual=parallel, shared_norm=parallel and (not new or n_ln == 1),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        max_seq_len=hf.get("max_position_embeddings", 2048), **_rope(hf))


def _mpt_config(hf: dict) -> ModelConfig:
    ac = hf.get("attn_config") or {}
    for key, ok in [("softmax_scale", None), ("qk_ln", False), ("prefix_lm", False)]:
        if ac.get(key, ok) not in (ok,):
            raise UnsupportedModel(f"mpt with attn_config.{key}={ac[key]!r} is not supported")
    if not ac.get("alibi", True):
        raise UnsupportedModel("mpt without ALiBi (learned positions) is not supported")
    if hf.get("logit_scale") not in (None, 1, 1.0):
        raise UnsupportedModel(f"mpt with logit_scale={hf['logit_scale']!r} is not supported")
    d = hf["d_model"]
    if float(ac.get("alibi_bias_max", 8)) != 8:
        # transformers' MPT builds its ALiBi slopes with the default 8 whatever the config says;
        # a checkpoint is what its reference implementation computes, so follow it.
        warnings.warn(f"mpt config.json sets attn_config.alibi_bias_max="
                      f"{ac['alibi_bias_max']}, which transformers ignores (it always uses 8); "
                      f"jaxllm follows transformers and uses 8", stacklevel=3)
    return ModelConfig.of_family(
        "mpt", vocab_size=hf["vocab_size"], hidden_size=d, num_layers=hf["n_layers"],
        num_heads=hf["n_heads"], intermediate_size=int(hf.get("expansion_ratio", 4) * d),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), qkv_clip=float(ac.get("clip_qkv") or 0.0),
        tie_embeddings=hf.get("tie_word_embeddings", True), max_seq_len=hf.get("max_seq_len", 2048))


def _opt_config(hf: dict) -> ModelConfig:
    if not hf.get("layer_norm_elementwise_affine", True):
        raise UnsupportedModel("opt with layer_norm_elementwise_affine=False is not supported")
    pre = hf.get("do_layer_norm_before", True)
    d, e = hf["hidden_size"], hf.get("word_embed_proj_dim") or hf["hidden_size"]
    bias = hf.get("enable_bias", True)
    return ModelConfig.of_family(
        "opt", vocab_size=hf["vocab_size"], hidden_size=d, num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], intermediate_size=hf["ffn_dim"],
        mlp=_act(hf.get("activation_function", "relu"), "opt", gated=False),
        attn_bias=bias, mlp_bias=bias, pre_norm=pre,
        final_norm=pre and not hf.get("_remove_final_layer_norm", False),
        embed_dim=0 if e == d else e, tie_embeddings=hf.get("tie_word_embeddings", True),
        max_seq_len=hf.get("max_position_embeddings", 2048))


_READERS = {"gpt_neox": _neox_config, "llama": _llama_config, "mistral": _llama_config,
            "falcon": _falcon_config, "mpt": _mpt_config, "opt": _opt_config}


def config_from_hf(hf: dict) -> ModelConfig:
    """A ``ModelConfig`` from an HF ``config.json`` dict; unsupported architectures raise."""
    mt = hf.get("model_type")
    if mt not in _READERS:
        raise UnsupportedModel(f"model_type {mt!r} is not supported; supported: "
                               f"{', '.join(SUPPORTED)}")
    try:
        return _READERS[mt](hf)
    except KeyError as e:
        raise ValueError(f"{mt} config.json lacks the field {e.args[0]!r}") from None
    except UnsupportedModel:
        raise
    except (ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"{mt} config.json has an invalid value: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF ``config.json`` for a GPT-NeoX, Llama or Mistral ``ModelConfig``. Writes both
    transformers-5 ``rope_parameters`` and the older keys, so either generation loads it."""
    if cfg.family not in EXPORTABLE:
        raise UnsupportedModel(f"export to Hugging Face supports {', '.join(EXPORTABLE)}; this "
                               f"model is {cfg.family}")
    if cfg.sink != "none":
        raise UnsupportedModel(f"a {cfg.sink}-sink model has no transformers equivalent (its "
                               f"{'extra embedding row' if cfg.sink == 'learnable' else 'softmax-off-by-one attention'}"
                               f" is not in any HF architecture); keep it in jaxllm's format")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type=s.kind, factor=s.factor)
        if s.kind == "llama3":
            rope.update(original_max_position_embeddings=s.original_max_len,
                        low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        elif s.kind in ("yarn", "ntk-by-parts"):  # transformers' yarn; by-parts: no temperature
            rope.update(rope_type="yarn", original_max_position_embeddings=s.original_max_len,
                        beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                        attention_factor=s.attention_scale)
        elif s.kind == "ntk":
            raise UnsupportedModel("static NTK RoPE scaling has no transformers rope_type; "
                                   "export the model with dynamic or yarn scaling instead")
        elif s.kind == "dynamic" and s.original_max_len != cfg.max_seq_len:
            raise UnsupportedModel("transformers' dynamic RoPE grows from max_position_embeddings;"
                                   " set original_max_len == max_seq_len to export")
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  intermediate_size=cfg.intermediate_size,
                  max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
                  rope_theta=cfg.rope_theta, torch_dtype="float32")
    if cfg.family == "gpt_neox":
        _require(cfg, norm="layernorm", mlp_bias=True, pos_emb="rope", shared_norm=False,
                 pre_norm=True, final_norm=True, norm_bias=True, embed_dim=0, qkv_clip=0.0,
                 sliding_window=0, num_kv_heads=cfg.num_heads,
                 head_dim=cfg.hidden_size // cfg.num_heads)
        act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[cfg.mlp]
        rope["partial_rotary_factor"] = cfg.rotary_pct
        return dict(common, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox",
                    hidden_act=act, layer_norm_eps=cfg.norm_eps, rotary_pct=cfg.rotary_pct,
                    rotary_emb_base=cfg.rope_theta, use_parallel_residual=cfg.parallel_residual,
                    attention_bias=cfg.attn_bias, rope_parameters=rope,
                    rope_scaling=None if cfg.rope_scaling is None else rope)
    _require(cfg, norm="rmsnorm", mlp="swiglu", pos_emb="rope", parallel_residual=False,
             pre_norm=True, final_norm=True, embed_dim=0, qkv_clip=0.0, rotary_pct=1.0)
    arch = "MistralForCausalLM" if cfg.family == "mistral" else "LlamaForCausalLM"
    extra = {"sliding_window": cfg.sliding_window or None} if cfg.family == "mistral" else {}
    if cfg.family == "llama" and cfg.sliding_window:
        raise UnsupportedModel("a llama config with sliding_window exports as family mistral")
    return dict(common, architectures=[arch], model_type=cfg.family, hidden_act="silu",
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                rms_norm_eps=cfg.norm_eps, attention_bias=cfg.attn_bias, mlp_bias=cfg.mlp_bias,
                rope_parameters=rope, rope_scaling=None if cfg.rope_scaling is None else rope,
                **extra)


def _require(cfg: ModelConfig, **want) -> None:
    bad = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if bad:
        raise UnsupportedModel(f"{cfg.family} models with {bad} have no Hugging Face equivalent "
                               f"(the {cfg.family} architecture needs {({k: want[k] for k in bad})})")


# ---- name maps ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor <-> one or more jaxllm parameters (paths joined by '/')."""

    hf: str
    shape: tuple[int, ...]  # the HF tensor's shape
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]
    optional: bool = False  # e.g. lm_head.weight of a tied model: read and ignored


def _same(hf, ours, shape):
    return Entry(hf, tuple(shape), (ours,), lambda a: (a,), lambda a: a)


def _linear(hf, ours, d_in, d_out, bias) -> list[Entry]:
    """torch Linear weight [out, in] <-> our kernel [in, out] (+ bias [out])."""
    out = [Entry(f"{hf}.weight", (d_out, d_in), (f"{ours}/kernel",),
                 lambda a: (a.T,), lambda a: a.T)]
    return out + ([_same(f"{hf}.bias", f"{ours}/bias", (d_out,))] if bias else [])


def _norm(hf, ours, d, bias) -> list[Entry]:
    out = [_same(f"{hf}.weight", f"{ours}/scale", (d,))]
    return out + ([_same(f"{hf}.bias", f"{ours}/bias", (d,))] if bias else [])


def _fused_qkv(hf, ours, cfg: ModelConfig, layout: str, bias: bool) -> list[Entry]:
    """A fused q/k/v projection, split into our q, k, v.

    ``grouped`` (GPT-NeoX, Falcon): rows are KV groups of [G query heads, 1 key, 1 value], each
    head_dim rows (GPT-NeoX is the case G=1, per head [q, k, v]). ``concat`` (MPT): [all q; k; v].
    """
    H, K, hd, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    G = H // K
    names = tuple(f"{ours}/{n}" for n in ("q", "k", "v"))

    def split(a):  # a: [(H + 2K) * hd, *rest] -> q [H*hd, *rest], k, v [K*hd, *rest]
        rest = a.shape[1:]
        if layout == "concat":
            return np.split(a, [H * hd, (H + K) * hd])
        g = a.reshape(K, G + 2, hd, *rest)
        return (g[:, :G].reshape(H * hd, *rest), g[:, G].reshape(K * hd, *rest),
                g[:, G + 1].reshape(K * hd, *rest))

    def join(q, k, v):
        if layout == "concat":
            return np.concatenate([q, k, v])
        rest = q.shape[1:]
        g = np.concatenate([q.reshape(K, G, hd, *rest), k.reshape(K, 1, hd, *rest),
                            v.reshape(K, 1, hd, *rest)], axis=1)
        return g.reshape((H + 2 * K) * hd, *rest)

    n = (H + 2 * K) * hd
    out = [Entry(f"{hf}.weight", (n, D), tuple(f"{x}/kernel" for x in names),
                 lambda a: tuple(t.T for t in split(a)), lambda q, k, v: join(q.T, k.T, v.T))]
    if bias:
        out.append(Entry(f"{hf}.bias", (n,), tuple(f"{x}/bias" for x in names), split, join))
    return out


def _head(cfg: ModelConfig, hf: str, embed: str) -> list[Entry]:
    """The output projection: our lm_head, or (tied) the embedding, with HF's copy ignored."""
    if cfg.tie_embeddings:
        return [Entry(hf, (cfg.vocab_size, cfg.embedding_dim), (embed,), lambda a: (),
                      lambda a: a, optional=True)]
    return [Entry(hf, (cfg.vocab_size, cfg.embedding_dim), ("lm_head/kernel",),
                  lambda a: (a.T,), lambda a: a.T)]


def _neox_names(cfg: ModelConfig) -> list[Entry]:
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    e = [_same("gpt_neox.embed_in.weight", "embed/embedding", (V, D))]
    for i in range(cfg.num_layers):
        hf, us = f"gpt_neox.layers.{i}", f"layer_{i}"
        e += _norm(f"{hf}.input_layernorm", f"{us}/ln_attn", D, True)
        e += _norm(f"{hf}.post_attention_layernorm", f"{us}/ln_mlp", D, True)
        e += _fused_qkv(f"{hf}.attention.query_key_value", f"{us}/attn", cfg, "grouped",
                        cfg.attn_bias)
        e += _linear(f"{hf}.attention.dense", f"{us}/attn/o", D, D, cfg.attn_bias)
        e += _linear(f"{hf}.mlp.dense_h_to_4h", f"{us}/mlp/up", D, F, True)
        e += _linear(f"{hf}.mlp.dense_4h_to_h", f"{us}/mlp/down", F, D, True)
    e += _norm("gpt_neox.final_layer_norm", "ln_final", D, True)
    # transformers 5 names the head lm_head and renames the older embed_out on load.
    return e + _head(cfg, "embed_out.weight", "embed/embedding")


def _llama_names(cfg: ModelConfig) -> list[Entry]:
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hd, Kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e = [_same("model.embed_tokens.weight", "embed/embedding", (V, D))]
    for i in range(cfg.num_layers):
        hf, us = f"model.layers.{i}", f"layer_{i}"
        e += _norm(f"{hf}.input_layernorm", f"{us}/ln_attn", D, False)
        e += _norm(f"{hf}.post_attention_layernorm", f"{us}/ln_mlp", D, False)
        for n, d_out in (("q", Hd), ("k", Kd), ("v", Kd)):
            e += _linear(f"{hf}.self_attn.{n}_proj", f"{us}/attn/{n}", D, d_out, cfg.attn_bias)
        e += _linear(f"{hf}.self_attn.o_proj", f"{us}/attn/o", Hd, D, cfg.attn_bias)
        e += _linear(f"{hf}.mlp.gate_proj", f"{us}/mlp/gate", D, F, cfg.mlp_bias)
        e += _linear(f"{hf}.mlp.up_proj", f"{us}/mlp/up", D, F, cfg.mlp_bias)
        e += _linear(f"{hf}.mlp.down_proj", f"{us}/mlp/down", F, D, cfg.mlp_bias)
    e += _norm("model.norm", "ln_final", D, False)
    return e + _head(cfg, "lm_head.weight", "embed/embedding")


def _falcon_names(cfg: ModelConfig) -> list[Entry]:
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    e = [_same("transformer.word_embeddings.weight", "embed/embedding", (V, D))]
    for i in range(cfg.num_layers):
        hf, us = f"transformer.h.{i}", f"layer_{i}"
        if cfg.shared_norm:  # one norm read by attention and MLP
            e += _norm(f"{hf}.input_layernorm", f"{us}/ln_attn", D, True)
        elif cfg.parallel_residual:  # new decoder architecture
            e += _norm(f"{hf}.ln_attn", f"{us}/ln_attn", D, True)
            e += _norm(f"{hf}.ln_mlp", f"{us}/ln_mlp", D, True)
        else:
            e += _norm(f"{hf}.input_layernorm", f"{us}/ln_attn", D, True)
            e += _norm(f"{hf}.post_attention_layernorm", f"{us}/ln_mlp", D, True)
        e += _fused_qkv(f"{hf}.self_attention.query_key_value", f"{us}/attn", cfg, "grouped",
                        cfg.attn_bias)
        e += _linear(f"{hf}.self_attention.dense", f"{us}/attn/o", D, D, cfg.attn_bias)
        e += _linear(f"{hf}.mlp.dense_h_to_4h", f"{us}/mlp/up", D, F, cfg.mlp_bias)
        e += _linear(f"{hf}.mlp.dense_4h_to_h", f"{us}/mlp/down", F, D, cfg.mlp_bias)
    e += _norm("transformer.ln_f", "ln_final", D, True)
    return e + _head(cfg, "lm_head.weight", "embed/embedding")


def _mpt_names(cfg: ModelConfig) -> list[Entry]:
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    e = [_same("transformer.wte.weight", "embed/embedding", (V, D))]
    for i in range(cfg.num_layers):
        hf, us = f"transformer.blocks.{i}", f"layer_{i}"
        e += _norm(f"{hf}.norm_1", f"{us}/ln_attn", D, False)
        e += _fused_qkv(f"{hf}.attn.Wqkv", f"{us}/attn", cfg, "concat", False)
        e += _linear(f"{hf}.attn.out_proj", f"{us}/attn/o", D, D, False)
        e += _norm(f"{hf}.norm_2", f"{us}/ln_mlp", D, False)
        e += _linear(f"{hf}.ffn.up_proj", f"{us}/mlp/up", D, F, False)
        e += _linear(f"{hf}.ffn.down_proj", f"{us}/mlp/down", F, D, False)
    e += _norm("transformer.norm_f", "ln_final", D, False)
    return e + _head(cfg, "lm_head.weight", "embed/embedding")


OPT_POS_OFFSET = 2  # OPT's position table has two leading rows no position ever reads


def _opt_names(cfg: ModelConfig) -> list[Entry]:
    D, F, V, E = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.embedding_dim
    L, b = cfg.max_seq_len, cfg.attn_bias
    pad = lambda a: np.concatenate([np.zeros((OPT_POS_OFFSET, D), a.dtype), a])
    e = [_same("model.decoder.embed_tokens.weight", "embed/embedding", (V, E)),
         Entry("model.decoder.embed_positions.weight", (L + OPT_POS_OFFSET, D),
               ("pos_embed/embedding",), lambda a: (a[OPT_POS_OFFSET:],), pad)]
    if E != D:
        e += _linear("model.decoder.project_in", "project_in", E, D, False)
        e += _linear("model.decoder.project_out", "project_out", D, E, False)
    for i in range(cfg.num_layers):
        hf, us = f"model.decoder.layers.{i}", f"layer_{i}"
        e += _norm(f"{hf}.self_attn_layer_norm", f"{us}/ln_attn", D, True)
        e += _norm(f"{hf}.final_layer_norm", f"{us}/ln_mlp", D, True)
        for n, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")):
            e += _linear(f"{hf}.self_attn.{n}_proj", f"{us}/attn/{ours}", D, D, b)
        e += _linear(f"{hf}.fc1", f"{us}/mlp/up", D, F, b)
        e += _linear(f"{hf}.fc2", f"{us}/mlp/down", F, D, b)
    if cfg.final_norm:
        e += _norm("model.decoder.final_layer_norm", "ln_final", D, True)
    return e + _head(cfg, "lm_head.weight", "embed/embedding")


NAMES = {"gpt_neox": _neox_names, "llama": _llama_names, "mistral": _llama_names,
         "falcon": _falcon_names, "mpt": _mpt_names, "opt": _opt_names}

# Where each family's base model sits; checkpoints saved from the base class (e.g. OPTModel)
# lack the prefix, and transformers 5 calls GPT-NeoX's head lm_head (older: embed_out).
BASE_PREFIX = {"gpt_neox": "gpt_neox.", "llama": "model.", "mistral": "model.",
               "falcon": "transformer.", "mpt": "transformer.", "opt": "model."}
ALIASES = {"gpt_neox": {"lm_head.weight": "embed_out.weight"}}
