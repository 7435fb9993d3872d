"""Score-based eviction: H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", §3) and Q-Hitter (Zhang et al., "Q-Hitter: A Better Token
Oracle for Efficient LLM Inference via Sparse-Quantized KV Cache", §3); docs/METHODS.md §6.

``sinks`` + ``heavy`` tokens chosen by accumulated attention (Q-Hitter: and quantization
friendliness, weight ``lam``) + the ``recent`` last ones (jaxllm.kv.evict). Budgets are counts,
or fractions in (0, 1) of the text or prompt, made counts by :meth:`H2O.resolve`."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from ..argtypes import is_budget
from ..config import ModelConfig
from ..errors import P, SettingError
from ..kinds import init_cache
from ..kv.cache import KVCache
from ..kv.evict import KIVI_BREAKS, Evict
from ..kv.quantized import KVQuant
from .base import CachePolicy, KVStorage, setting

QHITTER_KV = KVQuant("token", bits=4, group=0)  # the authors' quantizer: 4 bits, whole head


@dataclasses.dataclass(frozen=True)
class H2O(CachePolicy):
    """Heavy hitters by accumulated attention + recent tokens. ``heavy``/``recent`` None split
    the non-sink slots half and half (the paper's 10% + 10%)."""

    sinks: int = 0  # the H2O and Q-Hitter authors keep none
    cache: int = 1024
    heavy: Optional[float] = setting(
        None, "budget", "heavy-hitter slots: a count, or a fraction of the text/prompt (0.1 = "
        "10%); default: half (h2o) or 3/4 (qhitter) of the slots beside the sinks")
    recent: Optional[float] = setting(
        None, "budget", "most recent tokens kept, count or fraction (default: the rest)")
    storage: KVStorage = KVStorage()
    name = "h2o"
    title = "H2O"
    share = 0.5  # of the non-sink slots, heavy hitters' when no budget is given
    budgets: ClassVar[tuple] = ("heavy", "recent")  # the settings that may be fractions

    def __post_init__(self):
        for name in self.budgets:
            x = getattr(self, name)
            if x is not None and not is_budget(x):
                raise SettingError(f"{getattr(P, name)} must be a count (an integer >= 0) or a "
                                   f"fraction of the text in (0, 1), got {x}")
        if self.storage.quant.format == "kivi":
            raise SettingError(f"{KIVI_BREAKS}: use {P.kv_quant} token or int8 with "
                               f"{self.name}")
        self._check_slots()
        if not self.is_fraction:
            self.evict_spec()  # budget errors now, not at the first forward

    @property
    def is_fraction(self) -> bool:
        """Budgets given as fractions of the text (resolve() turns them into counts)."""
        return any(x is not None and x != int(x) for x in
                   (getattr(self, f) for f in self.budgets))

    def resolve(self, n_tokens: int) -> "H2O":
        """Fractional budgets as counts for a text or prompt of ``n_tokens`` (the authors'
        ``int(ratio * length)``; recent at least 1), the cache then sinks + heavy + recent."""
        if not self.is_fraction:
            return self
        count = lambda x: None if x is None else int(x) if x >= 1 or x == 0 else \
            int(x * n_tokens)  # noqa: E731
        counts = {f: count(getattr(self, f)) for f in self.budgets}
        heavy, recent = counts["heavy"], counts["recent"]
        counts["recent"] = recent = None if recent is None else max(recent, 1)
        cache = self.cache if heavy is None or recent is None else \
            self.sinks + heavy + recent
        return dataclasses.replace(self, cache=max(cache, self.sinks + 1), **counts)

    def _split(self) -> tuple[int, int]:
        """(heavy, recent) as counts, the missing one(s) filling the non-sink slots."""
        if self.is_fraction:
            raise ValueError("fractional budgets must be resolved against the text length "
                             "first: policy.resolve(n_tokens)")
        room = self.cache - self.sinks
        heavy, recent = self.heavy, self.recent
        if heavy is None and recent is None:
            heavy = int(room * self.share)
        if recent is None:
            recent = room - int(heavy)
        if heavy is None:
            heavy = room - int(recent)
        heavy, recent = int(heavy), int(recent)
        if self.sinks + heavy + recent > self.cache or heavy < 0:
            raise SettingError(f"{P.sinks} {self.sinks} + {P.heavy} {heavy} + {P.recent} "
                               f"{recent} exceed the cache of {self.cache} slots: lower "
                               f"{P.heavy}/{P.recent} or raise {P.cache}")
        if recent < 1:
            raise SettingError(f"{P.recent} must be >= 1 (the newest token is always kept); the "
                               f"cache {self.cache} leaves no room for it")
        return heavy, recent

    def evict_spec(self) -> Evict:
        """The jaxllm.kv.evict settings (counts; see resolve)."""
        return Evict("h2o", *self._split())

    @property
    def label(self) -> str:
        if self.is_fraction:
            pct = lambda x: "auto" if x is None else f"{x:.0%}" if x < 1 else str(int(x))  # noqa
            label = f"{self.title} {self.sinks}+{pct(self.heavy)}+{pct(self.recent)}"
        else:
            e = self.evict_spec()
            label = f"{self.title} {self.sinks}+{e.heavy}+{e.recent}" + self._detail(e)
        return label + self.storage.describe()

    def _detail(self, e: Evict) -> str:
        """What the label adds to the budgets."""
        return ""

    def make_cache(self, cfg: ModelConfig, batch: int, n_tokens: int, dtype=None) -> KVCache:
        return init_cache(cfg, batch, sinks=self.sinks, dtype=self._dtype(dtype),
                          kv_quant=self.storage.quant,
                          evict_by=self.resolve(n_tokens).evict_spec())


@dataclasses.dataclass(frozen=True)
class QHitter(H2O):
    """Heavy hitters by attention and by quantization friendliness (weight ``lam``; H2O is
    ``lam`` = 1) over a quantized cache (default the authors' 4-bit per-token codes). Without
    budgets the non-sink slots split 3:1 (the authors' 15% + 5%), 7/15 of the heavy ones by
    attention alone (``heavy_attn``)."""

    heavy_attn: Optional[float] = setting(
        None, "budget", "heavy slots chosen by attention alone (default 7/15 of the heavy "
        "ones, the authors' 7% of 15%)")
    lam: float = setting(0.5, "fraction", "λ, attention's weight against quantization error "
                         "(1 = H2O)")
    storage: KVStorage = KVStorage(quant=QHITTER_KV)
    name = "qhitter"
    title = "Q-Hitter"
    share = 0.75
    budgets: ClassVar[tuple] = ("heavy", "recent", "heavy_attn")

    def __post_init__(self):
        if not 0.0 <= self.lam <= 1.0:
            raise SettingError(f"{P.lam} must lie in [0, 1], got {self.lam}")
        super().__post_init__()

    def _detail(self, e: Evict) -> str:
        return f" (λ {e.lam:g}, {e.attn_only} by attention)"

    def evict_spec(self) -> Evict:
        heavy, recent = self._split()
        attn = round(heavy * 7 / 15) if self.heavy_attn is None else int(self.heavy_attn)
        if attn > heavy:
            raise SettingError(f"{P.heavy_attn} {attn} exceeds heavy {heavy}: the attention-only "
                               f"share is part of the heavy slots")
        return Evict("qhitter", heavy, recent, attn, self.lam)
