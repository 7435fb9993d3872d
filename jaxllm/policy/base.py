"""What every cache policy is: the base of the variants, and how a cache stores its keys and
values (:class:`KVStorage`), which is chosen apart from what the cache keeps."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax.numpy as jnp

from ..argtypes import BUDGET, FRACTION
from ..config import ModelConfig
from ..errors import P, SettingError
from ..kinds import init_cache
from ..kv.cache import KVCache
from ..kv.quantized import KVQuant
from ..positions import check_positions

KV_DTYPES = ("float32", "bfloat16", "float16")
KINDS = {"budget": BUDGET, "fraction": FRACTION}  # how the command line reads a setting


def setting(default, kind: str, help: str):
    """A method's own setting: a dataclass field the command line offers as ``--NAME``
    (``kind``: a key of KINDS; ``help``: its help line)."""
    return dataclasses.field(default=default, metadata={"kind": KINDS[kind], "help": help})


@dataclasses.dataclass(frozen=True)
class KVStorage:
    """How a cache stores keys and values: ``quant`` (jaxllm.kv.quantized; none keeps floats)
    and ``dtype``, the float dtype of a float cache or of a quantized cache's sinks. A bfloat16
    cache on a CPU keeps its bits as uint16 (jaxllm.kv.stores.Bf16Bits)."""

    dtype: str = "float32"
    quant: KVQuant = KVQuant()

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise SettingError(f"{P.kv_dtype} must be one of {', '.join(KV_DTYPES)}, got "
                               f"{self.dtype!r}")

    def describe(self) -> str:
        """``, KV int4 ... (sinks bfloat16)``, ``, KV bfloat16`` or nothing (float32)."""
        wide = "" if self.dtype == "float32" else self.dtype
        if self.quant.enabled:
            return f", KV {self.quant.describe()}" + (f" (sinks {wide})" if wide else "")
        return f", KV {wide}" if wide else ""


class CachePolicy:
    """What each prediction sees of its past: one variant per method (jaxllm.policy lists them),
    each a frozen dataclass holding only the settings its method has, so a setting that does
    not apply (sinks on a plain window, a quantized store for recompute) cannot be written.

    A variant says through its class attributes how the rest of jaxllm treats it."""

    name: ClassVar[str]  # the --method value
    title: ClassVar[str]  # its name in labels
    streams: ClassVar[bool] = True  # renumbers tokens by their place in the cache
    keeps_cache: ClassVar[bool] = True  # False: re-runs the model on every window
    sinks: int = 0  # the variants without a sinks field keep none
    storage: Optional[KVStorage] = None  # the variants that keep a cache declare theirs

    def _check_slots(self) -> None:
        """A window of at least one token beside ``sinks >= 0`` initial tokens."""
        if self.sinks < 0:
            raise SettingError(f"{P.sinks} must be >= 0, got {self.sinks}")
        if self.cache < 1:
            raise SettingError(f"{P.cache} must be >= 1, got {self.cache}")
        if self.cache - self.sinks < 1:
            raise SettingError(f"{P.cache} {self.cache} must exceed {P.sinks} {self.sinks}: the "
                               f"window ({P.cache} - {P.sinks}) must hold at least one token")

    def resolve(self, n_tokens: int) -> "CachePolicy":
        """This policy for a text or prompt of ``n_tokens`` (budgets given as fractions of it
        become counts)."""
        return self

    def slots(self, n_tokens: int) -> int:
        """Cache slots this policy uses over a text of ``n_tokens``."""
        return self.cache

    @property
    def window(self) -> int:
        """Recent tokens kept besides the sinks."""
        return self.cache - self.sinks

    @property
    def label(self) -> str:
        """``StreamingLLM 4+1020``, ``window 0+1024, KV bfloat16``, ..."""
        return f"{self.title} {self.sinks}+{self.window}" + (
            self.storage.describe() if self.storage else "")

    def check(self, cfg: ModelConfig, n_tokens: int) -> None:
        """Refuse, before any work, what ``cfg``'s positions cannot do under this policy over
        ``n_tokens`` tokens, and a KV storage that does not fit its head dim."""
        check_positions(cfg, n_tokens, self.streams)
        if self.storage is not None:
            self.storage.quant.check(cfg.head_dim)

    def make_cache(self, cfg: ModelConfig, batch: int, n_tokens: int, dtype=None) -> KVCache:
        """The KV cache that streams ``n_tokens`` tokens under this policy, in ``dtype``
        (default: the storage's)."""
        return init_cache(cfg, batch, sinks=self.sinks, window=self.window,
                          dtype=self._dtype(dtype), kv_quant=self.storage.quant)

    def _dtype(self, dtype):
        return jnp.dtype(self.storage.dtype if dtype is None else dtype)
