"""A decode step's attention over the cache *as stored*, by the Pallas kernel
(pallas_kernels.decode): the ring's slots are read in their storage format (bfloat16, int8,
k-bit, KIVI's per-channel keys) and dequantized in registers, where the XLA form decodes the
whole layer into a float array first and then reads that (a step over a 2-bit cache then moved
more bytes than over the bfloat16 cache it compresses).

What the kernel does not read is attended here and folded into its state: the sink slots (full
precision, a handful), softmax-off-by-one's virtual key, and for KIVI the recent tokens kept in
full precision and the step's own token (jaxllm.attention.kivi). The kernel's splits of the
slots (flash-decoding) are merged with them by their maxima.

Chosen where jaxllm.attention.flash chooses its kernel (``kernels.attention``, auto: GPU and
TPU) for every store the kernel reads (:func:`usable`); the XLA form stays for the rest and on
CPU. Tuning (blocks, splits) is in docs/KERNELS.md.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import decode as kernel
from pallas_kernels.common import TARGET_PROGRAMS

from ..config import ModelConfig
from ..kv import stores
from ..rope import apply_rope
from . import flash
from . import scores as sc

BLOCK = 64  # slots per block (KIVI's keys: their group)


def usable(cfg: ModelConfig, layer_k, layer_v, rotate_keys: bool) -> bool:
    """Whether a decode step over these layers goes to the kernel: the kernel backend is chosen
    and it reads both stores at this model's head dim (full rotary when it rotates keys)."""
    if flash.backend(cfg.kernels.attention) != "pallas":
        return False
    kv, vv = stores.slots(layer_k), stores.slots(layer_v)
    if kv is None or vv is None:
        return False
    if rotate_keys and cfg.rotary_dim != cfg.head_dim:
        return False  # the kernel turns whole heads (partial rotary keeps the XLA form)
    C = kv[1][0].shape[1]
    return kernel.supports(kv[0], vv[0], cfg.head_dim, rotate_keys, C,
                           block_for(kv[0], C)) is None


def block_for(k_layout: kernel.Layout, C: int) -> int:
    if k_layout.kind == "channel":
        return k_layout.group
    b = BLOCK
    while b > C and b > 1:
        b //= 2
    return b


def partials(q, kl: kernel.Layout, karr: tuple, vl: kernel.Layout, varr: tuple, pick, dist,
             slopes, rope):
    """pallas_kernels.decode.partials over stored slots (q [N, Rq, G, D] in the natural
    channel order, scaled), split for the device, the splits merged: (m, l [N, G],
    acc [N, G, D]) in the natural channel order. The program's platform picks the lowering
    (Triton on GPU, Mosaic on TPU, else Triton interpreted: tests)."""
    N, C = karr[0].shape[:2]
    bk = block_for(kl, C)
    splits = max(1, min(-(-C // bk), -(-TARGET_PROGRAMS // N)))
    qp = kernel.permute(q, kl.per)

    def by(backend, interpret=False):
        def run(qp, karr, varr, pick, dist, slopes, rope):
            return kernel.partials(qp, karr, varr, pick, dist, slopes, rope, k_layout=kl,
                                   v_layout=vl, splits=splits, bk=bk, backend=backend,
                                   interpret=interpret)
        return run
    m, l, acc = jax.lax.platform_dependent(qp, karr, varr, pick, dist, slopes, rope,
                                           cuda=by("triton"), rocm=by("triton"),
                                           tpu=by("tpu"), default=by("triton", True))
    m, l, acc = kernel.merge(m, l, acc, axis=1)
    return m, l, kernel.unpermute(acc, kl.per)


def fold(parts) -> Float[Array, "n g d"]:
    """Online-softmax states (m, l [N, G], acc [N, G, D]) over disjoint keys -> the attention
    output over all of them."""
    m, l, acc = (jnp.stack(x, axis=1) for x in zip(*parts))
    m, l, acc = kernel.merge(m, l, acc, axis=1)
    return acc / l[..., None]


def dense_state(q, k, v, ok, dist=None, slopes=None):
    """The state of a few keys attended in jnp: q [N, G, D] (scaled), k, v [N, L, D] float,
    ``ok`` [N, L], ALiBi's dist [N, L] and slopes [N, G] -> (m, l [N, G], acc [N, G, D])."""
    s = jnp.einsum("ngd,nld->ngl", q, k.astype(jnp.float32))
    if dist is not None:
        s = s - slopes[..., None] * dist[:, None, :].astype(jnp.float32)
    ok = ok[:, None, :]
    s = jnp.where(ok, s, flash.NEG_INF)
    m = jnp.max(s, -1)
    e = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    return m, e.sum(-1), jnp.einsum("ngl,nld->ngd", e, v.astype(jnp.float32))


def virtual_zero(N: int, G: int, D: int):
    """Softmax-off-by-one's virtual key (score 0, value 0) as a state."""
    return (jnp.zeros((N, G), jnp.float32), jnp.ones((N, G), jnp.float32),
            jnp.zeros((N, G, D), jnp.float32))


def slopes_of(cfg: ModelConfig, B: int) -> Optional[Float[Array, "n g"]]:
    if cfg.pos_emb != "alibi":
        return None
    return jnp.tile(sc.model_slopes(cfg, grouped=True), (B, 1))


def attend(q, layer_k, layer_v, plan, cfg: ModelConfig, sinks: int, freq):
    """A decode step (jaxllm.attention.decode's plan) after its token is written: q
    [B, 1, H, Dh], the written layers -> out [B, 1, H, Dh] float32."""
    B, _, H, Dh = q.shape
    KVH, G = cfg.num_kv_heads, cfg.queries_per_kv
    N, S = B * KVH, sinks
    rope = plan.q.cos is not None
    R = 3 if rope else 1  # the query at the sinks', this lap's and last lap's positions
    qr = apply_rope(jnp.broadcast_to(q, (B, R, H, Dh)), plan.q.part(0, R)).astype(jnp.float32)
    qr = (qr / math.sqrt(Dh)).reshape(B, R, KVH, G, Dh).transpose(0, 2, 1, 3, 4).reshape(
        N, R, G, Dh)
    mask = plan.mask[:, 0]  # [B, C]
    C = mask.shape[1]
    ring = mask & (jnp.arange(C) >= S)[None, :]
    # The kernel scores the ring slots with the lap rotations (pick 1, 2 -> rows 0, 1).
    pick = jnp.where(ring, plan.pick - 1 if rope else 0, -1)
    alibi = cfg.pos_emb == "alibi"
    slopes = slopes_of(cfg, B)
    turn = None
    if plan.keys.cos is not None:  # keys stored before RoPE: ring slot s at s - S - W
        scale = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_scale
        turn = kernel.Rope(freq, -C, scale)
    (kl, karr), (vl, varr) = stores.slots(layer_k), stores.slots(layer_v)
    parts = [partials(qr[:, 1:] if rope else qr, kl, karr, vl, varr, pick,
                      plan.dist if alibi else None, slopes, turn)]
    if S:
        ks, vs = stores.sinks(layer_k, S), stores.sinks(layer_v, S)  # [B, KVH, S, Dh]
        if plan.keys.cos is not None:
            ks = apply_rope(ks.astype(jnp.float32), plan.keys.part(0, S), head_major=True)
        by_head = lambda a: jnp.repeat(a, KVH, axis=0)  # noqa: E731  [B, ...] -> [N, ...]
        parts.append(dense_state(qr[:, 0], ks.reshape(N, S, Dh), vs.reshape(N, S, Dh),
                                 by_head(mask[:, :S]),
                                 by_head(plan.dist[:, :S]) if alibi else None, slopes))
    if cfg.sink == "zero":
        parts.append(virtual_zero(N, G, Dh))
    return fold(parts).reshape(B, 1, H, Dh)
