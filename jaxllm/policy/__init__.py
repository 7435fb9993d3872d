"""Cache policies: which past tokens each prediction sees (StreamingLLM §3, docs/METHODS.md §1).

A policy is one variant of :class:`CachePolicy`, a frozen dataclass with only its method's
settings, plus (for those that keep a cache) a :class:`KVStorage`, how the cache stores keys and
values. Every entry point (ppl, evals, generate, the CLI, the demo, the benchmarks, training)
takes one::

    StreamingLLM(sinks=4, cache=1024)                # sinks + a ring of the last 1020
    Window(cache=1024)                               # the last 1024 only
    Dense(KVStorage("bfloat16"))                     # the whole text, stored in bfloat16
    Recompute(sinks=4, cache=1024)                   # re-run on every window, no cache
    H2O(cache=256, heavy=0.1, recent=0.1)            # scored eviction, budgets of the text
    QHitter(cache=256, lam=0.5)                      # and 4-bit per-token storage

A new method is one module here with its variant and one entry in :data:`METHODS` (the CLI's
``--method`` reads it); its ``make_cache`` picks the cache's kind (jaxllm.kinds), which says
how a chunk goes through the cache, and the class attributes ``streams`` and ``keeps_cache``
say which commands offer it. :func:`policy_of` builds a variant from a method name and the
settings a user gave, refusing those the method does not have by name.
"""
from __future__ import annotations

import dataclasses

from ..errors import P, SettingError
from .base import KV_DTYPES, CachePolicy, KVStorage, setting
from .dense import Dense
from .recompute import Recompute
from .scored import H2O, QHITTER_KV, QHitter
from .window import StreamingLLM, Window

METHODS: dict[str, type[CachePolicy]] = {
    p.name: p for p in (Dense, Window, StreamingLLM, Recompute, H2O, QHitter)}

__all__ = ["CachePolicy", "Dense", "H2O", "KVStorage", "KV_DTYPES", "METHODS", "QHITTER_KV",
           "not_taken", "QHitter", "Recompute", "StreamingLLM", "Window", "own_settings", "policy_of",
           "setting"]


def own_settings(methods=None) -> dict:
    """The settings of ``methods`` (default all) declared with :func:`setting`, which the
    command line offers as flags: name -> (the field, the methods that have it)."""
    out: dict = {}
    for m in methods or METHODS:
        for f in dataclasses.fields(METHODS[m]):
            if "help" in f.metadata:
                out.setdefault(f.name, (f, []))[1].append(m)
    return out


def policy_of(method: str, *, kv_quant=None, kv_dtype=None, **settings) -> CachePolicy:
    """The ``method`` variant with the ``settings`` given (None: not given, the variant's
    default). ``kv_quant``/``kv_dtype`` make its KVStorage; ``kv_quant`` None keeps the method's
    own quantizer (Q-Hitter's). A setting the method does not have is refused by name."""
    if method not in METHODS:
        raise SettingError(f"unknown {P.method} {method!r}; choose one of "
                           f"{', '.join(METHODS)}")
    cls = METHODS[method]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = {k: v for k, v in settings.items() if v is not None}
    for k in given:
        if k not in fields:
            raise not_taken(method, k, given[k])
    if kv_quant is not None or kv_dtype is not None:
        if "storage" not in fields:
            raise SettingError(f"{P.method} {method} keeps no KV cache between predictions: "
                               f"there is no KV cache to quantize or store in another dtype "
                               f"(leave out {P.kv_quant}/{P.kv_dtype})")
        own = fields["storage"].default
        given["storage"] = KVStorage(kv_dtype or own.dtype,
                                     own.quant if kv_quant is None else kv_quant)
    return cls(**given)


def not_taken(method: str, setting: str, value) -> SettingError:
    """The error for a ``setting`` that ``method`` does not have, naming the methods that do."""
    return SettingError(_not_taken_text(method, setting, value))


def _not_taken_text(method: str, setting: str, value) -> str:
    takers = [m for m, c in METHODS.items() if setting in {f.name for f in dataclasses.fields(c)}]
    if not takers:
        own = [f.name for f in dataclasses.fields(METHODS[method])]
        return f"no method has a setting {setting!r}; {method}'s are {', '.join(own)}"
    if setting == "sinks":
        return (f"{P.method} {method} keeps no sink tokens (got {P.sinks} {value}); use "
                f"{P.method} {' or '.join(takers)} for sinks")
    return (f"{getattr(P, setting)} applies to {P.method} {' or '.join(takers)}, not "
            f"{method}")
