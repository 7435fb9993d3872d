"""Model configuration: one frozen dataclass, the only static argument of the model functions."""
from __future__ import annotations

import dataclasses
from typing import Literal

FAMILIES = ("gpt_neox", "llama")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Two families share one code path; the fields below are the switches that tell them apart:

    * ``gpt_neox`` (Pythia): LayerNorm with bias, biases everywhere, GELU MLP, rotary on
      ``rotary_pct`` of each head's dims, parallel residual (optional), untied embeddings.
    * ``llama`` (Llama / Mistral): RMSNorm, no biases, SwiGLU MLP, grouped-query attention
      (``num_kv_heads`` < ``num_heads``), full rotary with ``rope_theta``, optionally tied embeddings.

    Use :meth:`gpt_neox` / :meth:`llama` to get the family defaults and override what differs.
    """

    family: Literal["gpt_neox", "llama"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "gelu"
    attn_bias: bool = True
    mlp_bias: bool = True
    parallel_residual: bool = True
    rotary_pct: float = 1.0
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    max_seq_len: int = 2048  # pre-training context; informational (streaming has no limit)
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay float32
    init_std: float = 0.02

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; supported: {', '.join(FAMILIES)}")
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

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that rotary embeddings rotate (GPT-NeoX ``rotary_ndims``)."""
        return int(self.head_dim * self.rotary_pct)

    # ---- family constructors -------------------------------------------------------------
    @classmethod
    def gpt_neox(cls, **kw) -> "ModelConfig":
        base = dict(family="gpt_neox", norm="layernorm", mlp="gelu", attn_bias=True,
                    mlp_bias=True, parallel_residual=True, rotary_pct=0.25, tie_embeddings=False)
        base.update(kw)
        base.setdefault("num_kv_heads", base["num_heads"])
        base.setdefault("intermediate_size", 4 * base["hidden_size"])
        return cls(**base)

    @classmethod
    def llama(cls, **kw) -> "ModelConfig":
        base = dict(family="llama", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", attn_bias=False,
                    mlp_bias=False, parallel_residual=False, rotary_pct=1.0, tie_embeddings=False)
        base.update(kw)
        base.setdefault("num_kv_heads", base["num_heads"])
        return cls(**base)

    # ---- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known: {sorted(known)}")
        return cls(**d)


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
