"""Model configuration: one frozen dataclass, the only static argument of the model functions."""
from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

FAMILIES = ("gpt_neox", "llama", "mistral", "falcon", "mpt", "opt")
MLPS = ("gelu", "gelu_tanh", "relu", "swiglu")
POSITIONS = ("rope", "alibi", "learned")
ROPE_KINDS = ("linear", "dynamic", "llama3", "ntk", "yarn", "ntk-by-parts")
SINKS = ("none", "learnable", "zero")


ATTENTION_KERNELS = ("auto", "blockwise", "materialised", "pallas")
INT8_KERNELS = ("auto", "xla", "cpu", "triton", "tpu")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation runs each op. Part of the static configuration every program is
    compiled for (``ModelConfig.kernels``), so a program built for one choice is never reused
    for another; not saved with a model (where it runs is not what it is).

    * ``attention``: ``blockwise`` (jnp, online softmax over blocks of keys), ``materialised``
      (all scores at once: the oracle, and what attention maps read), ``pallas`` (the Pallas
      kernels: flash prefill, decode over the cache as stored); ``auto``: pallas on GPU and
      TPU; on a CPU blockwise, and a decode step by the C++ kernel where it is built
      (pallas_kernels.cpu.decode_attention; a named form keeps XLA's).
    * ``int8``: the INT8, low-bit and weight-only products (pallas_kernels.resolve_backend):
      ``xla``, ``cpu`` (the C++ kernels), ``triton``, ``tpu``; ``auto``: by platform.

    The CLI takes its defaults from ``$JAXLLM_ATTENTION`` and ``$JAXLLM_INT8_BACKEND``
    (:meth:`from_env`, read once where it loads the model); the library reads no variable.
    """

    attention: str = "auto"
    int8: str = "auto"

    def __post_init__(self):
        for name, options in (("attention", ATTENTION_KERNELS), ("int8", INT8_KERNELS)):
            if getattr(self, name) not in options:
                raise ValueError(f"unknown {name} kernel {getattr(self, name)!r}; choose one of "
                                 f"{', '.join(options)}")

    @classmethod
    def from_env(cls) -> "Kernels":
        """The choices named by $JAXLLM_ATTENTION and $JAXLLM_INT8_BACKEND (auto where unset)."""
        import os
        try:
            return cls(os.environ.get("JAXLLM_ATTENTION") or "auto",
                       os.environ.get("JAXLLM_INT8_BACKEND") or "auto")
        except ValueError as e:
            raise ValueError(f"{e} ($JAXLLM_ATTENTION / $JAXLLM_INT8_BACKEND)") from None


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for context extension (the ``rope_scaling`` of HF Llama configs).

    * ``linear``: positions divided by ``factor`` (inverse frequencies divided by ``factor``).
    * ``dynamic`` (NTK): when a sequence is longer than ``original_max_len`` the base becomes
      ``theta * (factor * L / original_max_len - (factor - 1)) ** (d / (d - 2))``, L the sequence
      length. jaxllm takes L per row as the in-cache length after the current chunk and, because
      keys are cached before RoPE, applies the new base to every key. A full forward equals
      transformers'; cached decoding past the original length cannot (transformers keeps keys
      rotated with earlier bases, and its uncached generate recomputes every hidden state).
    * ``llama3``: Llama 3.1's per-frequency rule: wavelengths above
      ``original_max_len / low_freq_factor`` are divided by ``factor``, below
      ``original_max_len / high_freq_factor`` kept, and smoothly interpolated between.
    * ``ntk`` (static, "NTK-aware"): the base becomes ``theta * factor ** (d / (d - 2))``.
    * ``yarn`` (Peng et al. 2023, the reference code ``scaled_rope/``; docs/METHODS.md §6): per
      dimension index i < d/2 a linear ramp from extrapolation (θ_i, below ``low``) to
      interpolation (θ_i / factor, above ``high``), with ``low = floor(corr(beta_fast))``, ``high =
      ceil(corr(beta_slow))`` and ``corr(r) = d ln(original_max_len / (2πr)) / (2 ln theta)``; and
      an attention temperature: cos and sin are multiplied by ``attention_factor`` (default
      ``0.1 ln factor + 1``), so the logits by its square.
    * ``ntk-by-parts``: YaRN's ramp without the temperature (``attention_factor`` 1).
    """

    kind: Literal["linear", "dynamic", "llama3", "ntk", "yarn", "ntk-by-parts"]
    factor: float
    original_max_len: int = 0  # dynamic, llama3, yarn, ntk-by-parts
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn, ntk-by-parts
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None  # yarn: None is 0.1 ln(factor) + 1

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"unknown rope scaling {self.kind!r}; supported: "
                             f"{', '.join(ROPE_KINDS)}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind not in ("linear", "ntk") and self.original_max_len < 1:
            raise ValueError(f"{self.kind} rope scaling needs original_max_len (the pre-training "
                             f"context length)")
        if self.beta_fast <= self.beta_slow or self.beta_slow <= 0:
            raise ValueError(f"rope scaling needs beta_fast > beta_slow > 0, got "
                             f"{self.beta_fast} and {self.beta_slow}")

    @property
    def attention_scale(self) -> float:
        """The factor cos and sin are multiplied by (1 except for YaRN's temperature)."""
        if self.kind == "ntk-by-parts":
            return 1.0 if self.attention_factor is None else self.attention_factor
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


INT32_MAX = 2 ** 31 - 1  # sizes index int32 arrays


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    All families share one code path; these fields are the switches that tell them apart (use the
    family constructors, e.g. :meth:`gpt_neox` / :meth:`llama`, for the defaults):

    * ``gpt_neox`` (Pythia): LayerNorm, biases, GELU, rotary on ``rotary_pct`` of each head,
      parallel residual, untied embeddings.
    * ``llama`` / ``mistral``: RMSNorm, no biases, SwiGLU, grouped-query attention, full rotary,
      ``rope_scaling``; Mistral adds ``sliding_window``.
    * ``falcon``: LayerNorm, parallel attention and MLP (two norms, or one ``shared_norm``),
      multi-query or grouped KV heads, GELU, tied embeddings.
    * ``mpt``: ALiBi (``pos_emb="alibi"``), no biases anywhere (``norm_bias=False``), optional
      ``qkv_clip``, tied embeddings.
    * ``opt``: learned absolute positions (``pos_emb="learned"``), ReLU, pre- or post-LayerNorm
      (``pre_norm``), ``embed_dim`` < ``hidden_size`` adds project_in/out. Absolute positions
      mean OPT runs with dense caches only.
    """

    family: Literal["gpt_neox", "llama", "mistral", "falcon", "mpt", "opt"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm has a bias (MPT's have none)
    pre_norm: bool = True  # x + f(LN x); False: LN(x + f(x)) (OPT-350m)
    final_norm: bool = True  # a norm after the last block
    shared_norm: bool = False  # parallel residual reading one norm: x + Attn(LN x) + MLP(LN x)
    mlp: Literal["gelu", "gelu_tanh", "relu", "swiglu"] = "gelu"
    attn_bias: bool = True
    mlp_bias: bool = True
    parallel_residual: bool = True
    pos_emb: Literal["rope", "alibi", "learned"] = "rope"
    rotary_pct: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    alibi_bias_max: float = 8.0  # ALiBi slopes 2^(-alibi_bias_max * h / H') (MPT)
    sliding_window: int = 0  # >0: a token sees only the last `sliding_window` keys (Mistral)
    qkv_clip: float = 0.0  # >0: clamp q, k, v projections to [-qkv_clip, qkv_clip] (MPT)
    embed_dim: int = 0  # token embedding width; 0: hidden_size (OPT word_embed_proj_dim)
    tie_embeddings: bool = False
    max_seq_len: int = 2048  # pre-training context (the size of a learned position table)
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay float32
    init_std: float = 0.02
    # Sink-token pre-training (docs/METHODS.md §2): "learnable" adds one embedding row, id
    # ``sink_id`` = vocab_size, put first in every training sample and every stream; "zero" is
    # softmax-off-by-one, e^{x_i} / (1 + sum_j e^{x_j}), a key and value of all zeros.
    sink: Literal["none", "learnable", "zero"] = "none"
    # How the model's programs run, not what the model is (neither is saved): the kernels
    # (see Kernels), and whether a gradient recomputes each block's activations in its
    # backward pass instead of keeping them all from the forward (training's memory).
    kernels: Kernels = Kernels()
    remat: bool = False

    def __post_init__(self):
        def choice(name, options):
            if getattr(self, name) not in options:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; supported: "
                                 f"{', '.join(options)}")
        choice("family", FAMILIES)
        choice("mlp", MLPS)
        choice("pos_emb", POSITIONS)
        choice("norm", ("layernorm", "rmsnorm"))
        choice("sink", SINKS)
        if not isinstance(self.kernels, Kernels):
            raise ValueError(f"kernels must be a jaxllm.config.Kernels, got {self.kernels!r}")
        if isinstance(self.rope_scaling, dict):  # from JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT32_MAX:
                raise ValueError(f"{name} must be an integer in [1, {INT32_MAX}], got {v!r}")
        for name in ("head_dim", "embed_dim", "sliding_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT32_MAX:
                raise ValueError(f"{name} must be an integer in [0, {INT32_MAX}] (0: derived), "
                                 f"got {v!r}")
        for name in ("norm_eps", "init_std", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads "
                             f"{self.num_kv_heads} (grouped-query attention)")
        if not 0.0 <= self.rotary_pct <= 1.0:
            raise ValueError(f"rotary_pct must lie in [0, 1], got {self.rotary_pct}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dims (head_dim * rotary_pct = {self.rotary_dim}) must be even")
        if self.sliding_window < 0 or self.qkv_clip < 0:
            raise ValueError("sliding_window and qkv_clip must be >= 0 (0 disables them)")
        if self.shared_norm and not self.parallel_residual:
            raise ValueError("shared_norm applies to a parallel residual block only")
        if self.parallel_residual and not self.pre_norm:
            raise ValueError("a parallel residual block needs pre_norm=True (post-LN is sequential)")

    @property
    def embedding_dim(self) -> int:
        """Width of the token embedding (``embed_dim``, or ``hidden_size`` when 0)."""
        return self.embed_dim or self.hidden_size

    @property
    def sink_id(self) -> Optional[int]:
        """Id of the learnable sink token (its own embedding row past the vocabulary), or None."""
        return self.vocab_size if self.sink == "learnable" else None

    @property
    def embed_rows(self) -> int:
        """Rows of the input embedding: the vocabulary, plus the learnable sink's row."""
        return self.vocab_size + (self.sink == "learnable")

    @property
    def queries_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention; 1 for multi-head)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that rotary embeddings rotate (GPT-NeoX ``rotary_ndims``)."""
        return int(self.head_dim * self.rotary_pct) if self.pos_emb == "rope" else 0

    # ---- family constructors -------------------------------------------------------------
    @classmethod
    def of_family(cls, family: str, **kw) -> "ModelConfig":
        """The family's defaults (``FAMILY_DEFAULTS``) overridden by ``kw``; ``num_kv_heads``
        defaults to ``num_heads`` and ``intermediate_size`` to 4x hidden."""
        if family not in FAMILY_DEFAULTS:
            raise ValueError(f"unknown family {family!r}; supported: {', '.join(FAMILIES)}")
        base = dict(FAMILY_DEFAULTS[family], family=family)
        base.update(kw)
        base.setdefault("num_kv_heads", base["num_heads"])
        base.setdefault("intermediate_size", 4 * base["hidden_size"])
        return cls(**base)

    @classmethod
    def gpt_neox(cls, **kw) -> "ModelConfig":
        return cls.of_family("gpt_neox", **kw)

    @classmethod
    def llama(cls, **kw) -> "ModelConfig":
        return cls.of_family("llama", **kw)

    # ---- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        """The architecture as JSON (the kernel choice is not part of it)."""
        d = dataclasses.asdict(self)
        d.pop("kernels")
        d.pop("remat")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"kernels", "remat"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known: {sorted(known)}")
        return cls(**d)


_LLAMA = dict(norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", attn_bias=False, mlp_bias=False,
              parallel_residual=False)
FAMILY_DEFAULTS: dict[str, dict] = {
    "gpt_neox": dict(rotary_pct=0.25),
    "llama": _LLAMA,
    "mistral": dict(_LLAMA, sliding_window=4096),
    "falcon": dict(attn_bias=False, mlp_bias=False, tie_embeddings=True),
    "mpt": dict(pos_emb="alibi", norm_bias=False, attn_bias=False, mlp_bias=False,
                parallel_residual=False, tie_embeddings=True),
    "opt": dict(pos_emb="learned", mlp="relu", parallel_residual=False, tie_embeddings=True),
}


BYTE_VOCAB = 264  # 256 bytes + specials (see tokenizer.ByteTokenizer), padded to a multiple of 8

PRESETS: dict[str, ModelConfig] = {
    # The exact Pythia-160M architecture (vocab padded to 50304 as in the Pythia release).
    "pythia-160m": ModelConfig.gpt_neox(vocab_size=50304, hidden_size=768, num_layers=12,
                                        num_heads=12, intermediate_size=3072, max_seq_len=2048),
    # Byte-level small models for CPU work and tests.
    "pythia-tiny": ModelConfig.gpt_neox(vocab_size=BYTE_VOCAB, hidden_size=128, num_layers=2,
                                        num_heads=4, max_seq_len=512),
    "pythia-14m": ModelConfig.gpt_neox(vocab_size=BYTE_VOCAB, hidden_size=128, num_layers=6,
                                       num_heads=4, max_seq_len=2048),
    "llama-tiny": ModelConfig.llama(vocab_size=BYTE_VOCAB, hidden_size=128, num_layers=2,
                                    num_heads=4, num_kv_heads=2, intermediate_size=344,
                                    max_seq_len=512),
    # Llama-2-7B shapes, for benchmarks and memory arithmetic.
    "llama2-7b": ModelConfig.llama(vocab_size=32000, hidden_size=4096, num_layers=32,
                                   num_heads=32, intermediate_size=11008, norm_eps=1e-5,
                                   max_seq_len=4096),
}
