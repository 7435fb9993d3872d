"""What a model's positions allow: a learnable sink token in front of every stream, and the
learned absolute positions (OPT) that can neither stream nor read past their table.

These rules belong to the model, not to a cache policy: the forward pass, training and every
policy (jaxllm.policy) ask them."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .errors import P, SettingError


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


def check_positions(cfg: ModelConfig, n_positions: int, streams: bool = False,
                    what: Optional[str] = None) -> None:
    """Refuse what a learned-position model cannot do: stream (``streams``: a cache that
    renumbers tokens by their place in it), or read ``n_positions`` > its table (``what``: the
    thing that would, for the message; default a sequence): the table would clamp them
    silently."""
    if can_stream(cfg):
        return
    L = cfg.max_seq_len
    if streams:
        raise SettingError(f"{cfg.family} has learned absolute positions, so it cannot stream: "
                           f"a window or StreamingLLM cache renumbers tokens by their place in "
                           f"the cache, positions this model never learned to read. Use "
                           f"{P.method} dense (at most {L} tokens) or recompute ({P.cache} <= "
                           f"{L}), or a RoPE/ALiBi model for streaming")
    if n_positions > L:
        what = what or f"a sequence of {n_positions} tokens"
        raise ValueError(f"{cfg.family} has learned positions for {L} tokens; {what} exceeds "
                         f"them and would read positions it never learned: use at most {L}")
