"""Cache policies: which past tokens each prediction sees (StreamingLLM §3, docs/METHODS.md §1).

The one home of the rules every entry point (ppl, evals, generate, the CLI, the demo, the
benchmarks, training) shares:

* :class:`CachePolicy`: a method, its sink tokens and cache size, its window (``cache - sinks``),
  its label (``StreamingLLM 4+1020``) and the KV cache it needs;
* :func:`with_sink`: a learnable-sink model's stream starts with its sink token;
* :func:`can_stream` / :func:`check_positions`: learned absolute positions (OPT) cannot stream,
  nor read past their table.

Methods:

* ``dense``: one cache holding the whole text (no eviction).
* ``window``: the last ``cache`` tokens only (0 + W).
* ``streaming``: ``sinks`` initial tokens + the last ``cache - sinks`` (StreamingLLM).
* ``recompute``: sliding window with re-computation, the quality oracle: for every token the
  model is re-run from scratch on ``sinks`` initial tokens + the last ``cache - sinks`` tokens,
  O(T * cache^2).
* ``h2o`` / ``qhitter``: ``sinks`` + ``heavy`` tokens chosen by accumulated attention (Q-Hitter:
  and quantization friendliness, weight ``lam``) + the ``recent`` last ones (jaxllm.kv.evict).
  Budgets are counts, or fractions in (0, 1) of the text or prompt, resolved by :meth:`resolve`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .kv.cache import KVCache, init_cache
from .config import ModelConfig
from .errors import P, SettingError
from .kv.evict import Evict
from .kv.quantized import KVQuant

METHODS = ("dense", "window", "recompute", "streaming", "h2o", "qhitter")
SCORED = ("h2o", "qhitter")  # score-based eviction (jaxllm.kv.evict)
STREAMING = ("window", "streaming") + SCORED  # positions assigned within the cache
_NAMES = {"dense": "dense", "window": "window", "recompute": "recompute",
          "streaming": "StreamingLLM", "h2o": "H2O", "qhitter": "Q-Hitter"}
QHITTER_KV = KVQuant("token", bits=4, group=0)  # the authors' quantizer: 4 bits, whole head
KV_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """What each prediction sees: ``method`` (see the module docstring), ``sinks`` initial
    tokens kept, ``cache`` slots in all (sinks + window), fed ``chunk`` tokens per forward call
    (the chunk never changes the result)."""

    method: str = "streaming"
    sinks: int = 4
    cache: int = 1024  # total slots: sinks + window
    chunk: int = 256
    kv_quant: KVQuant = KVQuant()  # how the cache stores keys and values (jaxllm.kv.quantized)
    # h2o / qhitter: counts, or fractions in (0, 1) of the text (resolve()); None splits the
    # cache's non-sink slots (h2o: half and half, the paper's 10% + 10%; qhitter: 3:1, the
    # authors' 15% + 5%, and 7/15 of the heavy slots by attention alone)
    heavy: Optional[float] = None
    recent: Optional[float] = None
    heavy_attn: Optional[float] = None
    lam: float = 0.5  # qhitter's λ (h2o is λ = 1)
    # the float dtype of a float cache (of a quantized one's sinks): float32, bfloat16 or
    # float16; a bfloat16 cache on a CPU keeps its bits as uint16 (jaxllm.kv.stores.Bf16Bits)
    kv_dtype: str = "float32"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        for name in ("heavy", "recent", "heavy_attn"):
            x = getattr(self, name)
            if x is not None and (x < 0 or (x != int(x) and not 0 < x < 1)):
                raise ValueError(f"{name} must be a count (an integer >= 0) or a fraction of the "
                                 f"text in (0, 1), got {x}")
        if not 0.0 <= self.lam <= 1.0:
            raise SettingError(f"{P.lam} must lie in [0, 1], got {self.lam}")
        if self.method in SCORED and self.kv_quant.format == "kivi":
            raise ValueError("KIVI's key blocks follow a ring's order, which score-based "
                             "eviction breaks: use --kv-quant token or int8 with h2o/qhitter")
        if self.method not in SCORED and (self.heavy, self.recent, self.heavy_attn) != (
                None, None, None):
            raise ValueError(f"heavy/recent budgets apply to --method h2o or qhitter, not "
                             f"{self.method}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.method in ("dense", "window") and self.sinks:
            raise ValueError(f"--method {self.method} keeps no sink tokens (got sinks="
                             f"{self.sinks}); use --method streaming or recompute for sinks")
        if self.cache < 1:
            raise ValueError(f"cache must be >= 1, got {self.cache}")
        if self.method != "dense" and self.cache - self.sinks < 1:
            raise ValueError(f"cache {self.cache} must exceed sinks {self.sinks}: the window "
                             f"(cache - sinks) must hold at least one token")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.kv_quant.enabled and self.method == "recompute":
            raise ValueError("recompute re-runs the model on every window and keeps no cache, so "
                             "there is no KV cache to quantize; use dense, window or streaming")

        if self.method in SCORED and not self.is_fraction:
            self.evict_spec()  # budget errors now, not at the first forward

    @classmethod
    def of(cls, method: str = "streaming", sinks: Optional[int] = None, cache: int = 1024,
           chunk: int = 256, kv_quant: KVQuant = KVQuant(), kv_dtype: str = "float32",
           **budgets) -> "CachePolicy":
        """``sinks=None``: StreamingLLM's 4 for ``streaming``, none for the others (the H2O and
        Q-Hitter authors keep none). ``qhitter`` without a KV format stores 4-bit codes per
        token over the whole head (the authors' quantizer). ``budgets``: heavy, recent,
        heavy_attn, lam."""
        if sinks is None:
            sinks = 4 if method == "streaming" else 0
        if method == "qhitter" and not kv_quant.enabled:
            kv_quant = QHITTER_KV
        return cls(method, sinks, cache, chunk, kv_quant, kv_dtype=kv_dtype, **budgets)

    @property
    def is_fraction(self) -> bool:
        """Budgets given as fractions of the text (resolve() turns them into counts)."""
        return any(x is not None and x != int(x) for x in (self.heavy, self.recent,
                                                           self.heavy_attn))

    def resolve(self, n_tokens: int) -> "CachePolicy":
        """Fractional budgets as counts for a text or prompt of ``n_tokens`` (the authors'
        ``int(ratio * length)``; recent at least 1), the cache then sinks + heavy + recent."""
        if not self.is_fraction:
            return self
        count = lambda x: None if x is None else int(x) if x >= 1 or x == 0 else \
            int(x * n_tokens)  # noqa: E731
        heavy, recent, attn = count(self.heavy), count(self.recent), count(self.heavy_attn)
        recent = None if recent is None else max(recent, 1)
        cache = self.sinks + (heavy or 0) + (recent or 0)
        if heavy is None or recent is None:
            cache = self.cache
        return dataclasses.replace(self, heavy=heavy, recent=recent, heavy_attn=attn,
                                   cache=max(cache, self.sinks + 1))

    def evict_spec(self) -> Evict:
        """The jaxllm.kv.evict settings of an h2o/qhitter policy (counts; see resolve)."""
        if self.is_fraction:
            raise ValueError("fractional budgets must be resolved against the text length "
                             "first: policy.resolve(n_tokens)")
        room = self.cache - self.sinks
        heavy, recent = self.heavy, self.recent
        share = 0.5 if self.method == "h2o" else 0.75
        if heavy is None and recent is None:
            heavy = int(room * share)
        if recent is None:
            recent = room - int(heavy)
        if heavy is None:
            heavy = room - int(recent)
        heavy, recent = int(heavy), int(recent)
        if self.sinks + heavy + recent > self.cache or heavy < 0:
            raise ValueError(f"sinks {self.sinks} + heavy {heavy} + recent {recent} exceed the "
                             f"cache of {self.cache} slots: lower --heavy/--recent or raise "
                             f"--cache")
        if recent < 1:
            raise ValueError(f"recent must be >= 1 (the newest token is always kept); the "
                             f"cache {self.cache} leaves no room for it")
        if self.method == "h2o":
            return Evict("h2o", heavy, recent)
        attn = round(heavy * 7 / 15) if self.heavy_attn is None else int(self.heavy_attn)
        if attn > heavy:
            raise SettingError(f"{P.heavy_attn} {attn} exceeds heavy {heavy}: the attention-only "
                               f"share is part of the heavy slots")
        return Evict("qhitter", heavy, recent, attn, self.lam)

    @property
    def window(self) -> int:
        """Recent tokens kept besides the sinks."""
        return self.cache - self.sinks

    @property
    def label(self) -> str:
        """``StreamingLLM 4+1020``, ``window 0+1024``, ``recompute 4+1020`` or ``dense``."""
        name = _NAMES[self.method]
        label = name if self.method == "dense" else f"{name} {self.sinks}+{self.window}"
        if self.method in SCORED and self.is_fraction:
            pct = lambda x: "auto" if x is None else f"{x:.0%}" if x < 1 else str(int(x))  # noqa
            label = f"{name} {self.sinks}+{pct(self.heavy)}+{pct(self.recent)}"
        elif self.method in SCORED:
            e = self.evict_spec()
            label = f"{name} {self.sinks}+{e.heavy}+{e.recent}" + (
                f" (λ {e.lam:g}, {e.attn_only} by attention)" if e.method == "qhitter" else "")
        wide = "" if self.kv_dtype == "float32" else self.kv_dtype
        if self.kv_quant.enabled:
            return label + f", KV {self.kv_quant.describe()}" + (f" (sinks {wide})" if wide else "")
        return label + (f", KV {wide}" if wide else "")

    def make_cache(self, cfg: ModelConfig, batch: int, n_tokens: int, dtype=None) -> KVCache:
        """The KV cache that streams ``n_tokens`` tokens under this policy (a dense cache holds
        them all; recompute keeps none between predictions, so it has no cache), in ``dtype``
        (default: ``kv_dtype``)."""
        dtype = jnp.dtype(self.kv_dtype if dtype is None else dtype)
        if self.method == "recompute":
            raise ValueError("recompute re-runs the model on every window: it keeps no cache")
        if self.method == "dense":
            return init_cache(cfg, batch, sinks=0, window=n_tokens, ring=False, dtype=dtype,
                              kv_quant=self.kv_quant)
        if self.method in SCORED:
            return init_cache(cfg, batch, sinks=self.sinks, dtype=dtype, kv_quant=self.kv_quant,
                              evict_by=self.resolve(n_tokens).evict_spec())
        return init_cache(cfg, batch, sinks=self.sinks, window=self.window, dtype=dtype,
                          kv_quant=self.kv_quant)


def with_sink(cfg: ModelConfig, tokens, keep_length: bool = False):
    """The stream a model expects: a learnable-sink model (trained with its sink token first in
    every sample) gets ``cfg.sink_id`` in front of every row of ``tokens`` ([T] or [B, T], numpy
    or jax); other models get ``tokens`` unchanged. ``keep_length``: drop each row's last token
    so the shape stays."""
    if cfg.sink_id is None:
        return tokens
    xp = np if isinstance(tokens, np.ndarray) else jnp
    sink = xp.full(tokens.shape[:-1] + (1,), cfg.sink_id, tokens.dtype)
    out = xp.concatenate([sink, tokens], -1)
    return out[..., :-1] if keep_length else out


def can_stream(cfg: ModelConfig) -> bool:
    """Learned absolute positions (OPT) exist for stream positions 0..max_seq_len-1 only: a
    window or StreamingLLM cache renumbers tokens by their place in the cache, positions such a
    model never learned. RoPE and ALiBi models stream."""
    return cfg.pos_emb != "learned"


def check_positions(cfg: ModelConfig, method: str, n_positions: int) -> None:
    """Refuse what a learned-position model cannot do: stream (``window``/``streaming``), or
    read ``n_positions`` > its table (a dense cache over more tokens, a longer recompute window
    or training sequence): the position table would clamp them silently."""
    if can_stream(cfg):
        return
    L = cfg.max_seq_len
    if method in STREAMING:
        raise SettingError(f"{cfg.family} has learned absolute positions, so it cannot stream: "
                           f"a window or StreamingLLM cache renumbers tokens by their place in "
                           f"the cache, positions this model never learned to read. Use "
                           f"{P.method} dense (at most {L} tokens) or recompute ({P.cache} <= "
                           f"{L}), or a RoPE/ALiBi model for streaming")
    if n_positions > L:
        what = {"dense": f"a dense cache over {n_positions} tokens",
                "recompute": f"a recompute window of {n_positions}"}.get(
                    method, f"a sequence of {n_positions} tokens")
        raise ValueError(f"{cfg.family} has learned positions for {L} tokens; {what} exceeds "
                         f"them and would read positions it never learned: use at most {L}")
