"""What every cache kind is: a cache's static layout (how many slots, which are sinks, how keys
are stored) and what is done with it. A kind makes the cache's arrays, lays out the index
arithmetic of a chunk once per forward (shared by every layer), plans the attention the layers
run (jaxllm.attention) and returns the cache after the chunk. It rides in the cache as a static
field (``KVCache.kind``), so ``model.apply``, ``ppl``, ``generate`` and the CLI ask the cache's
kind and never which kind it is.

A kind is a frozen, hashable dataclass: two caches of different kinds compile to different
programs, two of the same kind share one.
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..config import ModelConfig
from ..kv.cache import KVCache, available_bytes
from ..kv.quantized import KVQuant, empty_store
from ..kv.stores import Bf16Bits

# Runs the model on a chunk through a cache: ``forward(cache, tokens [B, T], lens [B], in_loop)``
# -> (logits [B, T, V], cache); ``in_loop``: called inside a loop's body (the weights are then
# tied to the step's values: jaxllm.weight_only.loop_weights).
Forward = Callable[..., tuple]


def as_int(x, name: str) -> int:
    """Python and numpy integers alike (np.int64(2) is a fine batch size); never a float."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {x!r}")
    return int(x)


class CacheKind:
    """The base of the kinds (jaxllm.kinds lists them). A kind declares ``sinks`` (the first
    slots, which hold the stream's first tokens) and ``slots`` (the cache's length per row),
    and implements :meth:`layout`, :meth:`plan` and :meth:`advance`; the rest has defaults a
    kind overrides where it differs."""

    sinks: int
    keys_rotated: bool = False  # the cache keeps keys rotated at their slots' positions
    streams: bool = True  # positions are assigned in the cache (learned positions cannot)

    @property
    def slots(self) -> int:
        raise NotImplementedError

    # ---- making the cache ----------------------------------------------------------------
    def make(self, cfg: ModelConfig, batch: int, dtype=jnp.float32,
             kv_quant: Optional[KVQuant] = None) -> KVCache:
        """An empty cache of this kind for ``batch`` rows: keys and values in ``dtype``
        (float32, bfloat16, float16) or in ``kv_quant``'s codes (the sinks in ``dtype``).
        Refused in one line when it would not fit in the free memory."""
        batch = as_int(batch, "batch")
        if batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ValueError(f"the KV cache stores keys and values in a float dtype (float32, "
                             f"bfloat16, float16), got {jnp.dtype(dtype).name}: an integer cache "
                             f"would silently round them")
        kv_quant = kv_quant or KVQuant()
        kv_quant.check(cfg.head_dim)  # bad settings are named before any allocation
        one = lambda: (self.store(cfg, batch, dtype, kv_quant, False),  # noqa: E731
                       self.store(cfg, batch, dtype, kv_quant, True), self.state(cfg, batch))
        need = cfg.num_layers * sum(a.size * a.dtype.itemsize
                                    for a in jax.tree.leaves(jax.eval_shape(one)))
        have = available_bytes()
        if have is not None and need > have:
            raise ValueError(f"a cache of {self.sinks}+{self.slots - self.sinks} slots x batch "
                             f"{batch} needs {need / 2**30:.1f} GiB for its keys and values, but "
                             f"only {have / 2**30:.1f} GiB are free on "
                             f"{jax.devices()[0].device_kind}: use a smaller cache (window) or "
                             f"batch")
        layers = [one() for _ in range(cfg.num_layers)]
        state = tuple(s for _, _, s in layers if s is not None)
        return KVCache(k=tuple(k for k, _, _ in layers), v=tuple(v for _, v, _ in layers),
                       length=jnp.zeros((batch,), jnp.int32), head=jnp.zeros((batch,), jnp.int32),
                       kind=self, state=state)

    def store(self, cfg: ModelConfig, batch: int, dtype, kv_quant: KVQuant, values: bool):
        """One layer's keys (``values`` False) or values [B, kv_heads, slots, head_dim]: a float
        array (a bfloat16 one as its bits on a CPU: Bf16Bits) or a quantized store."""
        shape = (batch, cfg.num_kv_heads, self.slots, cfg.head_dim)
        if kv_quant.enabled:
            return empty_store(kv_quant, batch, cfg.num_kv_heads, self.slots, self.sinks,
                               cfg.head_dim, dtype)
        if jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu":
            return Bf16Bits(jnp.zeros(shape, jnp.uint16))
        return jnp.zeros(shape, dtype)

    def state(self, cfg: ModelConfig, batch: int):
        """A layer's own state beside its keys and values (None: the kind keeps none)."""
        return None

    # ---- a chunk through the cache -------------------------------------------------------
    def layout(self, cache: KVCache, lens: Int[Array, " b"], T: int):
        """Index arithmetic for a chunk of ``T`` tokens (``lens`` [B] valid), shared by the
        layers. It has ``seen_length`` [B]: what the chunk's last query sees."""
        raise NotImplementedError

    def plan(self, cfg: ModelConfig, lay, B: int, T: int, freq):
        """The attention plan the layers run (jaxllm.attention): ``plan.attend(q, k, v,
        layer_cache, cfg, int8_att, keep_probs)``. ``freq`` [B, r/2]: RoPE's inverse
        frequencies."""
        raise NotImplementedError

    def advance(self, cache: KVCache, lay, logits: Float[Array, "b t v"], k: tuple, v: tuple,
                state: tuple) -> tuple[Float[Array, "b t v"], KVCache]:
        """The logits and the cache after the chunk, from each layer's new keys, values and
        state."""
        raise NotImplementedError

    def prefill_block(self, batch: int) -> Optional[int]:
        """Tokens per block when a longer chunk goes through in blocks inside one program
        (None: a chunk of any length goes through whole)."""
        return None

    def bucket(self, T: int, batch: int) -> int:
        """The padded length a T-token prompt is fed at (prompts that share it share a compiled
        program); the default pads nothing."""
        return T

    def check_room(self, cache: KVCache, need) -> None:
        """Refuse, before any work, rows that would hold ``need`` [B] tokens (concrete) if the
        kind cannot hold them. Kinds that evict always have room."""

    def score(self, forward: Forward, cache: KVCache, tokens: Int[Array, "b t"],
              lens: Int[Array, " b"]) -> tuple[Float[Array, "b t v"], KVCache]:
        """A chunk's logits as streaming perplexity scores them: each token predicted from
        what the kind keeps of its past. The default feeds the chunk whole (a chunk's logits
        equal token-by-token's for the kinds that keep every token of their window)."""
        return forward(cache, tokens, lens, False)
