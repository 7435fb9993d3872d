"""The KV cache: one pytree (:mod:`.cache`: sink slots + a ring, a window, or dense; its kinds
and init_cache are jaxllm.kinds'), its storage formats behind one protocol (:mod:`.stores`: float arrays, bfloat16 bits;
:mod:`.quantized`: int8, k-bit, KIVI), and score-based eviction's bookkeeping (:mod:`.evict`:
H2O, Q-Hitter). Attention reads and writes it only through that protocol
(jaxllm.attention)."""
from .cache import KVCache, kv_bytes
from .evict import Evict
from .quantized import KVQuant

__all__ = ["Evict", "KVCache", "KVQuant", "kv_bytes"]
