"""Naive numpy references, independent of the Flax code: a transformer written from the
papers' formulas, and the StreamingLLM cache as the authors' eval loop does it (a Python list of
pre-RoPE keys and values, trimmed to S+W after every token, re-rotated at positions 0..n-1)."""
from __future__ import annotations

import math

import numpy as np


def _np(tree):
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)


def _norm(x, p, cfg):
    if cfg.norm == "rmsnorm":
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * p["scale"]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + cfg.norm_eps) * p["scale"] + p["bias"]


def _lin(x, p):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def _gelu(x):
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def _rope(x, pos, cfg):
    """x [n, heads, hd] rotated to positions pos [n]: rotate-half on the first rotary_dim dims."""
    r = cfg.rotary_dim
    if r == 0:
        return x
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2) / r)
    ang = np.asarray(pos, np.float64)[:, None] * inv  # [n, r/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : r // 2], x[..., r // 2: r]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], -1)


def _attn_out(q, ks, vs, q_pos, k_pos, cfg):
    """One query [H, hd] over keys/values [n, KVH, hd] at the given positions."""
    G = cfg.num_heads // cfg.num_kv_heads
    qr = _rope(q[None], [q_pos], cfg)[0]
    kr = _rope(ks, k_pos, cfg)
    out = np.zeros_like(q)
    for h in range(cfg.num_heads):
        s = kr[:, h // G] @ qr[h] / math.sqrt(cfg.head_dim)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ vs[:, h // G]
    return out


class NaiveStream:
    """Token-by-token reference: one row, a list cache holding the sinks and the last W tokens.

    window=None keeps everything (a dense cache; with sinks=0 it is the plain causal forward).
    """

    def __init__(self, params, cfg, sinks=0, window=None):
        self.p, self.cfg, self.S, self.W = _np(params), cfg, sinks, window
        self.kept = []  # stream indices of kept tokens
        self.kv = [[] for _ in range(cfg.num_layers)]  # per layer: list of (k, v) pre-RoPE
        self.t = 0

    def step(self, token: int) -> np.ndarray:
        cfg, p = self.cfg, self.p
        x = p["embed"]["embedding"][token]
        self.kept.append(self.t)
        # Token t attends to sinks 0..S-1 and tokens t-W+1..t (REFERENCE §1): S+W keys with itself.
        trim = self.W is not None and len(self.kept) > self.S + self.W
        if trim:
            del self.kept[self.S]
        for li in range(cfg.num_layers):
            lp = p[f"layer_{li}"]
            h = _norm(x, lp["ln_attn"], cfg)
            q = _lin(h, lp["attn"]["q"]).reshape(cfg.num_heads, cfg.head_dim)
            k = _lin(h, lp["attn"]["k"]).reshape(cfg.num_kv_heads, cfg.head_dim)
            v = _lin(h, lp["attn"]["v"]).reshape(cfg.num_kv_heads, cfg.head_dim)
            self.kv[li].append((k, v))
            if trim:  # evict the oldest non-sink token
                del self.kv[li][self.S]
            ks = np.stack([a for a, _ in self.kv[li]])
            vs = np.stack([b for _, b in self.kv[li]])
            n = len(ks)
            a = _attn_out(q, ks, vs, n - 1, np.arange(n), cfg).reshape(-1)
            a = _lin(a, lp["attn"]["o"])
            m_in = _norm(x, lp["ln_mlp"], cfg) if cfg.parallel_residual else None
            if not cfg.parallel_residual:
                x = x + a
                m_in = _norm(x, lp["ln_mlp"], cfg)
            mp = lp["mlp"]
            if cfg.mlp == "swiglu":
                g = _lin(m_in, mp["gate"])
                m = _lin((g / (1 + np.exp(-g))) * _lin(m_in, mp["up"]), mp["down"])
            else:
                m = _lin(_gelu(_lin(m_in, mp["up"])), mp["down"])
            x = x + a + m if cfg.parallel_residual else x + m
        x = _norm(x, p["ln_final"], cfg)
        head = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
        logits = x @ head
        self.t += 1
        return logits

    def run(self, tokens) -> np.ndarray:
        return np.stack([self.step(int(t)) for t in tokens])


def naive_logits(params, cfg, tokens, sinks=0, window=None) -> np.ndarray:
    """[B, T] tokens -> [B, T, V] logits, each row streamed independently."""
    return np.stack([NaiveStream(params, cfg, sinks, window).run(row) for row in np.asarray(tokens)])
