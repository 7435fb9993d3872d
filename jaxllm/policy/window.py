"""Window attention and StreamingLLM (Xiao et al., "Efficient Streaming Language Models with
Attention Sinks", §3.2; docs/METHODS.md §1): the last tokens in a ring, positions assigned by
their place in the cache; StreamingLLM keeps ``sinks`` initial tokens beside them."""
from __future__ import annotations

import dataclasses

from .base import CachePolicy, KVStorage


@dataclasses.dataclass(frozen=True)
class Window(CachePolicy):
    """The last ``cache`` tokens only (0 + W): collapses once the first tokens leave."""

    cache: int = 1024
    storage: KVStorage = KVStorage()
    name = "window"
    title = "window"

    def __post_init__(self):
        self._check_slots()


@dataclasses.dataclass(frozen=True)
class StreamingLLM(CachePolicy):
    """``sinks`` initial tokens (the attention sinks) + the last ``cache - sinks``."""

    sinks: int = 4
    cache: int = 1024
    storage: KVStorage = KVStorage()
    name = "streaming"
    title = "StreamingLLM"

    def __post_init__(self):
        self._check_slots()
