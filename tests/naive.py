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
    return (x - mu) / np.sqrt(var + cfg.norm_eps) * p["scale"] + p.get("bias", 0.0)


def _lin(x, p):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def _gelu(x):
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def _inv_freq(cfg, seq_len):
    """RoPE inverse frequencies from the formulas (docs/METHODS.md §6; Llama 3.1 for llama3)."""
    r, s, theta = cfg.rotary_dim, cfg.rope_scaling, cfg.rope_theta
    if s is not None and s.kind == "dynamic" and seq_len > s.original_max_len:
        theta = theta * (s.factor * seq_len / s.original_max_len - (s.factor - 1)) ** (r / (r - 2))
    inv = 1.0 / theta ** (np.arange(0, r, 2) / r)
    if s is None or s.kind == "dynamic":
        return inv
    if s.kind == "linear":
        return inv / s.factor
    out = []
    for f in inv:  # llama3, one frequency at a time
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_len / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_len / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            a = (s.original_max_len / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - a) * f / s.factor + a * f)
    return np.asarray(out)


def _rope(x, pos, cfg, seq_len):
    """x [n, heads, hd] rotated to positions pos [n]: rotate-half on the first rotary_dim dims;
    seq_len is the in-cache length (dynamic NTK scaling reads it)."""
    r = cfg.rotary_dim
    if r == 0:
        return x
    inv = _inv_freq(cfg, seq_len)
    ang = np.asarray(pos, np.float64)[:, None] * inv  # [n, r/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : r // 2], x[..., r // 2: r]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], -1)


def _slope(h, H, bias_max):
    """ALiBi slope of head h (0-based): geometric in 2^(-bias_max/H') over the next power of two
    H' >= H; for H < H', the odd-numbered slopes of H' first, then the even ones."""
    n2 = 1 << (H - 1).bit_length()
    all_slopes = [2.0 ** (-bias_max * (i + 1) / n2) for i in range(n2)]
    return (all_slopes[1::2] + all_slopes[::2])[h] if n2 != H else all_slopes[h]


def _attn_out(q, ks, vs, q_pos, k_pos, cfg, sinks=0):
    """One query [H, hd] over keys/values [n, KVH, hd] at the given in-cache positions; the
    first ``sinks`` keys are exempt from a sliding window."""
    G = cfg.num_heads // cfg.num_kv_heads
    qr = _rope(q[None], [q_pos], cfg, len(ks))[0]
    kr = _rope(ks, k_pos, cfg, len(ks))
    dist = q_pos - np.asarray(k_pos, np.float64)
    out = np.zeros_like(q)
    for h in range(cfg.num_heads):
        s = kr[:, h // G] @ qr[h] / math.sqrt(cfg.head_dim)
        if cfg.pos_emb == "alibi":
            s = s - _slope(h, cfg.num_heads, cfg.alibi_bias_max) * dist
        if cfg.sliding_window:
            s = np.where((dist >= cfg.sliding_window) & (np.arange(len(s)) >= sinks), -np.inf, s)
        v = vs[:, h // G]
        if cfg.sink == "zero":  # the zero sink, literally: a prepended key and value of zeros
            zero_k, zero_v = np.zeros(cfg.head_dim), np.zeros((1, cfg.head_dim))
            s = np.concatenate([[zero_k @ qr[h] / math.sqrt(cfg.head_dim)], s])
            v = np.concatenate([zero_v, v])
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v
    return out


class NaiveStream:
    """Token-by-token reference: one row, a list cache holding the sinks and the last W tokens.

    window=None keeps everything (a dense cache; with sinks=0 it is the plain causal forward).
    """

    def __init__(self, params, cfg, sinks=0, window=None, kv_store=None, kv_list=None):
        if cfg.pos_emb == "learned" or not cfg.pre_norm or cfg.embedding_dim != cfg.hidden_size:
            raise NotImplementedError("the naive stream covers RoPE/ALiBi pre-norm models")
        self.p, self.cfg, self.S, self.W = _np(params), cfg, sinks, window
        self.kept = []  # stream indices of kept tokens
        self.kv = [[] for _ in range(cfg.num_layers)]  # per layer: list of (k, v) pre-RoPE
        self.t = 0
        # kv_store(x) -> what a quantized cache returns for a non-sink token's k or v [heads, D]
        self.kv_store = kv_store
        # kv_list() -> a per-layer list cache with add/evict/view/after (a quantizing policy
        # whose stored values depend on when they are flushed, e.g. KIVI)
        self.lists = [kv_list() for _ in range(cfg.num_layers)] if kv_list else None

    def _attention(self, li, q, k, v, trim):
        """The attention output [H, hd] of layer ``li``'s query, its cache updated."""
        if self.lists is not None:
            self.lists[li].add(k, v, sink=self.t < self.S)
            if trim:
                self.lists[li].evict()
            ks, vs = self.lists[li].view()
        else:
            if self.kv_store is not None and self.t >= self.S:  # sinks: full precision
                k, v = self.kv_store(k), self.kv_store(v)
            self.kv[li].append((k, v))
            if trim:  # evict the oldest non-sink token
                del self.kv[li][self.S]
            ks = np.stack([a for a, _ in self.kv[li]])
            vs = np.stack([b for _, b in self.kv[li]])
        n = len(ks)
        return _attn_out(q, ks, vs, n - 1, np.arange(n), cfg=self.cfg, sinks=self.S)

    def step(self, token: int) -> np.ndarray:
        cfg, p = self.cfg, self.p
        x = p["embed"]["embedding"][token]
        self.kept.append(self.t)
        # Token t attends to sinks 0..S-1 and tokens t-W+1..t (docs/METHODS.md §1): S+W keys
        # with itself.
        trim = self.W is not None and len(self.kept) > self.S + self.W
        if trim:
            del self.kept[self.S]
        for li in range(cfg.num_layers):
            lp = p[f"layer_{li}"]
            h = _norm(x, lp["ln_attn"], cfg)
            clip = (lambda y: np.clip(y, -cfg.qkv_clip, cfg.qkv_clip)) if cfg.qkv_clip else (
                lambda y: y)
            q = clip(_lin(h, lp["attn"]["q"])).reshape(cfg.num_heads, cfg.head_dim)
            k = clip(_lin(h, lp["attn"]["k"])).reshape(cfg.num_kv_heads, cfg.head_dim)
            v = clip(_lin(h, lp["attn"]["v"])).reshape(cfg.num_kv_heads, cfg.head_dim)
            a = _lin(self._attention(li, q, k, v, trim).reshape(-1), lp["attn"]["o"])
            if self.lists is not None:
                self.lists[li].after()  # quantize after the step's attention
            if cfg.parallel_residual:
                m_in = h if cfg.shared_norm else _norm(x, lp["ln_mlp"], cfg)
            else:
                x = x + a
                m_in = _norm(x, lp["ln_mlp"], cfg)
            mp = lp["mlp"]
            if cfg.mlp == "swiglu":
                g = _lin(m_in, mp["gate"])
                m = _lin((g / (1 + np.exp(-g))) * _lin(m_in, mp["up"]), mp["down"])
            else:
                u = _lin(m_in, mp["up"])
                act = {"gelu": _gelu, "relu": lambda y: np.maximum(y, 0),
                       "gelu_tanh": lambda y: 0.5 * y * (1 + np.tanh(
                           math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))}[cfg.mlp]
                m = _lin(act(u), mp["down"])
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


class NaiveEvictStream(NaiveStream):
    """H2O / Q-Hitter token by token (jaxllm.kv.evict's rules, from docs/METHODS.md §4): per
    layer and KV head a Python list of kept entries in stream order; each token is appended,
    attended to at list positions 0..n-1 (position rolling), its group's attention added to every
    entry's score; then, above S+H+R entries, the lowest-scoring candidate (neither one of the
    first S nor one of the last R) is deleted. ``lam < 1``: Q-Hitter's combined score, with the
    ``attn_only`` best candidates by attention kept first; ``kv_store`` quantizes non-sinks."""

    def __init__(self, params, cfg, sinks, heavy, recent, lam=1.0, attn_only=0, kv_store=None):
        super().__init__(params, cfg, sinks)
        self.C, self.R, self.lam, self.A = sinks + heavy + recent, recent, lam, attn_only
        self.store = kv_store or (lambda x: x)
        # per layer, per KV head: entries [k, v, acc, e_k, e_v]
        self.heads = [[[] for _ in range(cfg.num_kv_heads)] for _ in range(cfg.num_layers)]

    def _attention(self, li, q, k, v, trim):
        cfg = self.cfg
        G, hd = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        out = np.zeros((cfg.num_heads, hd))
        sink = self.t < self.S
        for h, entries in enumerate(self.heads[li]):
            ks_, vs_ = (k[h], v[h]) if sink else (self.store(k[h]), self.store(v[h]))
            entries.append([ks_, vs_, 0.0, np.linalg.norm(ks_ - k[h]),
                            np.linalg.norm(vs_ - v[h])])
            n = len(entries)
            ks = np.stack([e[0] for e in entries])[:, None]
            kr = _rope(ks, np.arange(n), cfg, n)[:, 0]
            for g in range(G):
                hq = h * G + g
                qr = _rope(q[hq][None, None], [n - 1], cfg, n)[0, 0]
                s = kr @ qr / math.sqrt(hd)
                if cfg.pos_emb == "alibi":
                    s = s - _slope(hq, cfg.num_heads, cfg.alibi_bias_max) * (n - 1 - np.arange(n))
                w = np.exp(s - s.max())
                w = w / w.sum()
                out[hq] = w @ np.stack([e[1] for e in entries])
                for e, wi in zip(entries, w):
                    e[2] += wi
        if len(self.heads[li][0]) > self.C:
            self._evict(self.heads[li])
        return out

    def _evict(self, heads):
        def norm(vals):  # min-max over every head's entries of the layer
            allv = np.concatenate(vals)
            lo, hi = allv.min(), allv.max()
            return [(x - lo) / (hi - lo) if hi > lo else np.zeros_like(x) for x in vals]
        acc = norm([np.array([e[2] for e in es]) for es in heads])
        ek = norm([np.array([e[3] for e in es]) for es in heads])
        ev = norm([np.array([e[4] for e in es]) for es in heads])
        for h, es in enumerate(heads):
            n = len(es)
            cand = list(range(self.S, n - self.R))
            raw = np.array([es[i][2] for i in cand])
            default = set(np.array(cand)[np.argsort(-raw)[:self.A]]) if self.A else set()
            score = {i: self.lam * acc[h][i] + (1 - self.lam) * (1 - (ek[h][i] + ev[h][i]) / 2)
                     if self.lam < 1 else es[i][2] for i in cand if i not in default}
            del es[min(score, key=score.get)]


def rounded_weights(params, dtype: str) -> dict:
    """The float model with its linear kernels and embedding table rounded to ``dtype`` and kept
    float32 [in, out]: what a weight store in that dtype (quant.decode_weights) must compute,
    through the plain float path."""
    import jax.numpy as jnp
    from jaxllm import tree
    return tree.unflatten({k: jnp.asarray(v).astype(dtype).astype(jnp.float32)
                           if k.endswith("/kernel") or k == "embed/embedding" else v
                           for k, v in tree.flatten(params).items()})
