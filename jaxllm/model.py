"""The transformer: Flax modules that take the KV cache as an argument and return the new one."""
from __future__ import annotations

import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.reference import after

from . import attention
from .attention import plain
from .kv import cache as kvc
from .config import ModelConfig
from .positions import check_positions
from .lowbit import QLowBit
from .quant import QKernel
from .rope import inv_freq


def is_quantized_node(x) -> bool:
    """A quantized or decode-layout weight (jaxllm.quant.QKernel, jaxllm.lowbit.QLowBit): a node
    that runs its own product (``matmul``, and as an embedding ``lookup`` and ``head``)."""
    return isinstance(x, (QKernel, QLowBit))


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


class Linear(nn.Module):
    """y = x @ kernel (+ bias); kernel [in, out]. Params stay float32, compute in ``dtype``."""

    features: int
    use_bias: bool
    std: float
    dtype: jnp.dtype = jnp.float32
    int8: str = "auto"  # the INT8 / low-bit products' implementation (ModelConfig.kernels)

    @nn.compact
    def __call__(self, x):
        # The input's per-channel max |x|, collected only when "intermediates" is mutable
        # (SmoothQuant calibration); otherwise dead code that XLA drops.
        self.sow("intermediates", "in_absmax",
                 jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0),
                 reduce_fn=lambda a, b: b, init_fn=lambda: 0.0)
        # The whole input, collected only when "inputs" is mutable (GPTQ's Hessians).
        self.sow("inputs", "x", x.reshape(-1, x.shape[-1]), reduce_fn=lambda a, b: b,
                 init_fn=lambda: 0.0)
        kernel = self.get_variable("params", "kernel")
        if is_quantized_node(kernel):  # INT8, weight-only or k-bit: the node's own product
            y = kernel.matmul(x, self.dtype, self.int8)
        else:
            kernel = self.param("kernel", nn.initializers.normal(self.std),
                                (x.shape[-1], self.features))
            y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
        return y


class Embed(nn.Module):
    """Token embedding [vocab, dim]; ``attend`` is the tied output head. An int8 table
    (``QKernel`` with per-row scales) dequantizes the looked-up rows and runs the head in INT8;
    a k-bit one (``QLowBit``: a GGUF file's Q8_0 blocks kept) dequantizes the looked-up rows
    and multiplies the head by :func:`jaxllm.lowbit.matmul`."""

    vocab: int
    dim: int
    std: float
    int8: str = "auto"  # the tied head's product (ModelConfig.kernels)

    @nn.compact
    def __call__(self, tokens):
        table = self.get_variable("params", "embedding")
        if is_quantized_node(table):  # the looked-up rows only, dequantized
            return table.lookup(tokens)
        table = self.param("embedding", nn.initializers.normal(self.std), (self.vocab, self.dim))
        return table[tokens]

    def attend(self, x, vocab: int):
        """Logits over the first ``vocab`` rows (a learnable sink's row is input-only)."""
        table = self.get_variable("params", "embedding")
        if is_quantized_node(table):
            return table.head(x, vocab, self.int8)
        return jnp.einsum("...d,vd->...v", x, table[:vocab])


class Norm(nn.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale only), computed in float32."""

    kind: str
    eps: float
    use_bias: bool = True  # LayerNorm only

    @nn.compact
    def __call__(self, x):
        xf = x.astype(jnp.float32)
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if self.kind == "rmsnorm":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps) * scale
        else:
            mu = jnp.mean(xf, -1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
            y = (xf - mu) * jax.lax.rsqrt(var + self.eps) * scale
            if self.use_bias:
                y = y + self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        return y.astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, plan: attention.Plan):
        cfg = self.cfg
        B, T, _ = x.shape
        dt, k8 = _dtype(cfg), cfg.kernels.int8
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

        def proj(heads, name):
            y = Linear(heads * cfg.head_dim, cfg.attn_bias, cfg.init_std, dt, k8, name=name)(x)
            if cfg.qkv_clip:
                y = jnp.clip(y, -cfg.qkv_clip, cfg.qkv_clip)
            return y.reshape(B, T, heads, cfg.head_dim)  # [B, T, heads, Dh]

        # Keys and values head-major [B, KVH, T, Dh], the cache's layout: a decode step then reads
        # each head's keys as one contiguous [L, Dh] matrix instead of transposing the cache.
        q = proj(cfg.num_heads, "q")
        k, v = (proj(cfg.num_kv_heads, n).transpose(0, 2, 1, 3) for n in ("k", "v"))
        # QAttention: INT8 QKᵀ and PV (SmoothQuant), or None
        int8_att = self.get_variable("params", "int8_attention")

        keep = self.is_mutable_collection("attention")
        ctx, new_cache, probs = plan.attend(q, k, v, layer_cache, cfg, int8_att, keep)
        if probs is not None:  # attention maps for analysis (jaxllm.evals.attention)
            self.sow("attention", "probs", probs.reshape(B, cfg.num_heads, T, T),
                     reduce_fn=lambda a, b: b, init_fn=lambda: 0.0)
        ctx = ctx.reshape(B, T, cfg.num_heads * cfg.head_dim).astype(dt)
        return Linear(cfg.hidden_size, cfg.attn_bias, out_std, dt, k8, name="o")(ctx), new_cache


ACTIVATIONS = {"gelu": lambda h: jax.nn.gelu(h, approximate=False),
               "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
               "relu": jax.nn.relu}


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg, dt, k8 = self.cfg, _dtype(self.cfg), self.cfg.kernels.int8
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        up = Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt, k8, name="up")
        if cfg.mlp == "swiglu":
            gate = Linear(cfg.intermediate_size, cfg.mlp_bias, cfg.init_std, dt, k8,
                          name="gate")(x)
            h = jax.nn.silu(gate) * up(x)
        else:
            h = ACTIVATIONS[cfg.mlp](up(x))
        return Linear(cfg.hidden_size, cfg.mlp_bias, out_std, dt, k8, name="down")(h)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, plan: attention.Plan):
        cfg = self.cfg
        ln1 = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="ln_attn")
        ln2 = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="ln_mlp")
        attn = Attention(cfg, name="attn")
        mlp = MLP(cfg, name="mlp")
        if not cfg.pre_norm:  # post-LN (OPT-350m): normalise after each residual add
            a, new_cache = attn(x, layer_cache, plan)
            h = ln1(x + a)
            return ln2(h + mlp(h)), new_cache
        h1 = ln1(x)
        a, new_cache = attn(h1, layer_cache, plan)
        if cfg.parallel_residual:  # x + Attn(LN1 x) + MLP(LN2 x), or one shared LN (Falcon-7B)
            return x + a + mlp(h1 if cfg.shared_norm else ln2(x)), new_cache
        h = x + a
        return h + mlp(ln2(h)), new_cache


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, cache: Optional[kvc.KVCache], lay: Optional[kvc.ChunkLayout],
                 positions: Optional[Int[Array, "b t"]] = None,
                 rows: Optional[Int[Array, "b k"]] = None, hidden: bool = False,
                 part: str = "whole"):
        """-> (logits [B, T, V] float32, or [B, K, V] at the positions ``rows`` [B, K] only,
        or with ``hidden`` the head's input [B, T, D] (:func:`head_logits` makes the logits);
        the new per-layer (keys, values, scores)).

        ``part`` (a chunk through a cache one program per part, :func:`apply_by_layer`): "embed"
        returns the first block's input [B, T, D] alone; "head" takes the last block's output
        as ``tokens`` and returns the logits alone."""
        cfg = self.cfg
        if part not in ("whole", "embed", "head"):
            raise ValueError(f"part must be 'whole', 'embed' or 'head', got {part!r}")
        dt = _dtype(cfg)
        k8 = cfg.kernels.int8
        embed = Embed(cfg.embed_rows, cfg.embedding_dim, cfg.init_std, k8, name="embed")

        def head(x):
            if rows is not None:  # the head only where logits are wanted ([B, T, V] is large)
                x = jnp.take_along_axis(x, rows[:, :, None], axis=1)
            if cfg.final_norm:
                x = Norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="ln_final")(x)
            if cfg.embedding_dim != cfg.hidden_size:
                x = Linear(cfg.embedding_dim, False, cfg.init_std, dt, k8, name="project_out")(x)
            if hidden:
                return x
            if cfg.tie_embeddings:
                return embed.attend(x.astype(jnp.float32), cfg.vocab_size).astype(jnp.float32)
            return Linear(cfg.vocab_size, False, cfg.init_std, dt, k8,
                          name="lm_head")(x).astype(jnp.float32)

        if part == "head":
            return head(tokens)
        B, T = tokens.shape
        x = embed(tokens).astype(dt)
        if cfg.embedding_dim != cfg.hidden_size:  # OPT: embeddings narrower than the model
            x = Linear(cfg.hidden_size, False, cfg.init_std, dt, k8, name="project_in")(x)
        if cfg.pos_emb == "learned":  # absolute positions (dense caches only, see check_chunk)
            pos = jnp.arange(T)[None] + (0 if cache is None else cache.length[:, None])
            pos = pos if positions is None else positions
            pos = jnp.minimum(pos, cfg.max_seq_len - 1)  # padding past the table is never read
            x = x + nn.Embed(cfg.max_seq_len, cfg.hidden_size,
                             embedding_init=nn.initializers.normal(cfg.init_std),
                             name="pos_embed")(pos).astype(dt)
        lens = None if lay is None else getattr(lay, "lens", None)
        if lens is not None:
            # A row a chunk leaves alone (no valid token: a finished or idle row of a batch)
            # computes from zeros: its results are never read, and zero rows cost the CPU's
            # low-bit products nothing (pallas_kernels/csrc/lowbit_rows.cc).
            x = jnp.where((lens > 0)[:, None, None], x, jnp.zeros((), x.dtype))
        if part == "embed":
            return x
        plan = chunk_plan(cfg, cache, lay, B, T, positions)
        new_k, new_v, new_s = [], [], []
        # The first block's input, collected only when "block_inputs" is mutable (GPTQ's
        # block-by-block calibration, block_apply).
        self.sow("block_inputs", "x", x, reduce_fn=lambda a, b: b, init_fn=lambda: 0.0)
        # Each block is its own jitted call when nothing is collected from inside it: traced
        # and lowered once for all layers of one kind (JAX caches the trace by argument types),
        # which XLA inlines again. Unrolled, a 30-layer model spent 6 s of every program's
        # build tracing and lowering the same block 30 times (docs/CPU.md, compile once).
        shared = not (self.is_initializing() or any(
            self.is_mutable_collection(c) for c in ("intermediates", "attention", "inputs")))
        block_jit = _block_jit(cfg.remat) if shared else None
        # Stacked layers (stack_layers; apply passes them here only for a plain forward that
        # collects nothing): one block's program run under a scan, so a training step's trace,
        # compile and code are one layer's, whatever the depth.
        stacked = shared and "layers" in self.variables["params"]
        if stacked:
            x = _scan_blocks(cfg, self.variables["params"]["layers"], x, plan)
        for layer in range(0 if stacked else cfg.num_layers):
            layer_cache = None if cache is None else (cache.k[layer], cache.v[layer]) + \
                cache.state[layer:layer + 1]  # + the kind's own state, if it keeps one
            if shared:
                x, nc = _block_call(block_jit, cfg, self.variables["params"][f"layer_{layer}"],
                                    x, layer_cache, plan)
            else:
                x, nc = Block(cfg, name=f"layer_{layer}")(x, layer_cache, plan)
            if nc is not None:
                new_k.append(nc[0])
                new_v.append(nc[1])
                new_s.extend(nc[2:])
        return head(x), (tuple(new_k), tuple(new_v), tuple(new_s))


def chunk_plan(cfg: ModelConfig, cache: Optional[kvc.KVCache], lay, B: int, T: int,
               positions=None) -> attention.Plan:
    """The attention plan every layer of a forward runs: RoPE's frequencies, positions, tables
    and masks, made once (only dynamic NTK scaling depends on the length)."""
    seq_len = jnp.full((B,), T, jnp.int32) if lay is None else lay.seen_length
    if positions is not None:  # explicit positions: the sequence reaches the largest + 1
        seq_len = jnp.max(positions, axis=1).astype(jnp.int32) + 1
    freq = inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, seq_len)
    if cache is None:
        return plain.plan(cfg, B, T, freq, positions)
    return cache.kind.plan(cfg, lay, B, T, freq)


class _Static:
    """A value passed to jit as a static argument, compared by identity of its parts' values
    (the Python numbers, bools, strings and Nones of a plan's pytree)."""

    def __init__(self, leaves):
        self.leaves = leaves

    def __hash__(self):
        return hash(tuple((type(x), x) for x in self.leaves))

    def __eq__(self, other):
        return isinstance(other, _Static) and len(self.leaves) == len(other.leaves) and all(
            type(a) is type(b) and a == b for a, b in zip(self.leaves, other.leaves))


_ARRAY = object()  # where an array leaf was


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def split_static(tree) -> tuple[list, tuple]:
    """``tree``'s arrays, and the rest (its structure and its Python values: a plan's sink
    counts and flags) as one hashable value, so that the tree can cross a jit boundary with
    the rest static (:func:`join_static` puts it together again)."""
    leaves, tdef = jax.tree.flatten(tree, is_leaf=lambda v: v is None)
    return ([v for v in leaves if _is_array(v)],
            (tdef, _Static([_ARRAY if _is_array(v) else v for v in leaves])))


def join_static(static: tuple, arrays) -> object:
    tdef, rest = static
    it = iter(arrays)
    return jax.tree.unflatten(tdef, [next(it) if v is _ARRAY else v for v in rest.leaves])


def _block_call(block_jit, cfg: ModelConfig, layer_params, x, layer_cache, plan):
    """One block applied through ``block_jit`` (:func:`_block_jit`); the Python values inside
    the cache and the plan (sink counts, flags) stay static, as they are in the unrolled form."""
    arrays, static = split_static((layer_cache, plan))
    return block_jit(cfg, static, layer_params, x, arrays)


def _block_jit(remat: bool = False):
    """A jitted block made for one forward's trace: its layers share the one trace, and the
    next forward traces afresh, so whatever a block reads while traced (a size a test sets)
    is read again for every program, as unrolled. ``remat``: a gradient keeps only each
    block's inputs and recomputes the rest (:func:`_recomputed`)."""
    def block(cfg, static, layer_params, x, arrays):
        layer_cache, plan = join_static(static, arrays)
        return Block(cfg).apply({"params": layer_params}, x, layer_cache, plan)
    if remat:
        block = _recomputed(block)
    return jax.jit(block, static_argnums=(0, 1))


def _recomputed(block):
    """``block`` whose backward pass recomputes its activations from its inputs, the only
    values the forward keeps for it. The recomputation is tied to the block's incoming
    cotangent (``after``), so it runs in the backward pass and XLA cannot merge it with the
    forward's equal values (jax.checkpoint's optimization barriers do not hold on XLA:CPU:
    docs/CPU.md, "Peak memory")."""
    def run(cfg, static, layer_params, x, arrays):
        def f(p, x, a):
            return block(cfg, static, p, x, a)

        @jax.custom_vjp
        def g(p, x, a):
            return f(p, x, a)

        def fwd(p, x, a):
            return f(p, x, a), (p, x, a)

        def bwd(saved, ct):
            p, x, a = saved
            tie = next(c for c in jax.tree.leaves(ct) if jnp.issubdtype(c.dtype, jnp.inexact))
            return jax.vjp(f, p, after(tie, x), a)[1](ct)
        g.defvjp(fwd, bwd)
        return g(layer_params, x, arrays)
    return run


def _scan_blocks(cfg: ModelConfig, layers, x: Float[Array, "b t d"], plan):
    """x through every layer of ``layers`` (each leaf [L, ...]) under one ``lax.scan``. With
    ``cfg.remat`` the backward pass recomputes each block from its input, the only value the
    forward keeps per layer (the recomputation sits in the backward loop's body, where XLA
    cannot merge it with the forward's). Without, it keeps each block's matmul outputs and
    recomputes the rest (MaxText's "minimal" policy): a scan that kept every value the backward
    reads would stack all of them per layer, more than the unrolled program keeps, where XLA
    fuses and frees them (docs/GUIDE.md, training memory)."""
    def body(x, layer_params):
        return Block(cfg).apply({"params": layer_params}, x, None, plan)[0], None
    policy = None if cfg.remat else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    body = jax.checkpoint(body, prevent_cse=False, policy=policy)
    return jax.lax.scan(body, x, layers)[0]


def stack_layers(params: dict) -> dict:
    """``params`` with its blocks ``layer_0 .. layer_{L-1}`` as one subtree ``layers`` whose
    leaves carry a leading [L] axis (MaxText's ``scan_layers``): a plain forward (training's)
    then runs one block's program under a scan. Every other use of the model (a cache, a
    collection) takes the blocks one by one again (:func:`unstack_layers`), which copies
    them: keep inference's parameters unstacked."""
    names = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
    if not names:
        raise ValueError("stack_layers: no layer_0 .. layer_N blocks in these parameters "
                         "(stacked already?)")
    rest = {k: v for k, v in params.items() if not k.startswith("layer_")}
    return {**rest, "layers": jax.tree.map(lambda *a: jnp.stack(a), *(params[k] for k in names))}


def unstack_layers(params: dict) -> dict:
    """The inverse of :func:`stack_layers` (parameters without ``layers`` come back as they
    are): the per-layer form that converters, quantizers and saved models use."""
    if "layers" not in params:
        return params
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{f"layer_{i}": jax.tree.map(lambda a, i=i: a[i], stacked)
                       for i in range(n)}}


def head_logits(params, cfg: ModelConfig, x: Float[Array, "... d"]) -> Float[Array, "... v"]:
    """The output head on the head's input x (``apply(..., hidden=True)``): float32 logits,
    computed as the model computes them (a tied head in float32, an untied one in the compute
    dtype). Float weights only (training's)."""
    if cfg.tie_embeddings:
        return jnp.einsum("...d,vd->...v", x.astype(jnp.float32),
                          params["embed"]["embedding"][:cfg.vocab_size])
    dt = _dtype(cfg)
    return jnp.einsum("...i,io->...o", x.astype(dt),
                      params["lm_head"]["kernel"].astype(dt)).astype(jnp.float32)


def block_apply(layer_params, cfg: ModelConfig, x: Float[Array, "b t d"], mutable=()):
    """One block of a plain causal forward on its input x (positions 0..T-1): the output, or
    ``(output, collections)`` with ``mutable`` (e.g. ``["inputs"]``: each linear's input)."""
    B, T = x.shape[:2]
    plan = chunk_plan(cfg, None, None, B, T)
    if not mutable:
        return Block(cfg).apply({"params": layer_params}, x, None, plan)[0]
    (y, _), state = Block(cfg).apply({"params": layer_params}, x, None, plan,
                                     mutable=list(mutable))
    return y, state


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Random parameters (normal(init_std), output projections scaled by 1/sqrt(2L))."""
    return Transformer(cfg).init(key, jnp.zeros((1, 1), jnp.int32), None, None)["params"]


def apply(params, cfg: ModelConfig, tokens: Int[Array, "b t"],
          cache: Optional[kvc.KVCache] = None, lens: Optional[Int[Array, " b"]] = None, *,
          mutable=(), positions: Optional[Int[Array, "b t"]] = None, last_only: bool = False,
          hidden: bool = False):
    """The model as a traceable function: ``(logits [B, T, V] float32, cache)``.

    The one way every module runs the model inside its own ``jit`` (generate's loop, ppl's
    scoring, calibration, attention maps, the training loss, the benchmarks); it does no input
    checking, so call :func:`forward` (checked, jitted) from plain Python. ``cache=None``: a
    plain causal forward at positions 0..T-1 (the cache returned is None); with a cache,
    ``lens`` [B] are the valid tokens per row (int32). ``mutable`` (plain forward only): flax
    collections to collect, e.g. ``["intermediates"]`` (each linear's input maxima, for
    SmoothQuant's calibration) or ``["attention"]`` (attention probabilities); the result is
    then ``(logits, None, state)``. ``positions`` [B, T] (plain forward only): each token's
    position id, increasing along the row (PoSE's skipped positions); default 0..T-1.
    ``last_only``: the logits of each row's last valid token only, [B, 1, V] (a prefill that
    samples the next token needs no more). ``hidden`` (plain forward, nothing collected): the
    head's input [B, T, D] instead of the logits (a loss over a large vocabulary makes the
    logits a piece at a time with :func:`head_logits`). ``params`` may hold the blocks stacked
    (:func:`stack_layers`): a plain forward that collects nothing scans them, anything else
    takes them one by one again.
    """
    B, T = tokens.shape
    if "layers" in params and (cache is not None or mutable):  # the scan is a plain forward's
        params = unstack_layers(params)
    if cache is None:
        rows = jnp.full((B, 1), T - 1, jnp.int32) if last_only else None
        if not mutable:
            return Transformer(cfg).apply({"params": params}, tokens, None, None,
                                          positions, rows, hidden)[0], None
        (logits, _), state = Transformer(cfg).apply({"params": params}, tokens, None, None,
                                                    positions, rows, mutable=list(mutable))
        return logits, None, state
    if mutable or positions is not None:
        raise ValueError("mutable collections and explicit positions apply to a plain forward "
                         "(cache=None); with a cache, positions are assigned within the cache")
    # A kind without blocks (score-based eviction, which prefills as its authors do: the whole
    # chunk attends fully, then is compressed once) takes any chunk whole.
    blk = cache.kind.prefill_block(B)
    if blk is None or T <= blk:
        return _forward_chunk(params, cfg, tokens, cache, lens, last_only)
    # A longer chunk goes through in blocks of blk tokens (a scan inside the same jit; chunking
    # never changes the logits).
    n = -(-T // blk)
    blocks = jnp.pad(tokens, ((0, 0), (0, n * blk - T))).reshape(B, n, blk).transpose(1, 0, 2)
    block_lens = jnp.clip(lens[None, :] - blk * jnp.arange(n, dtype=lens.dtype)[:, None], 0, blk)
    V = cfg.vocab_size
    out = jnp.zeros((B, 1, V) if last_only else (B, n * blk, V), jnp.float32)

    def step(carry, xs):
        c, out = carry
        i, block, block_len = xs
        # Tied to the step, so what XLA derives from a weight (a converted or dequantized copy)
        # is made per block instead of hoisted out of the loop, where every layer's copy would
        # be alive at once (docs/BENCHMARKS.md, prefill temporaries at compile time).
        p, _ = jax.lax.optimization_barrier((params, i))
        logits, c = _forward_chunk(p, cfg, block, c, block_len, last_only)
        if last_only:  # the last block holding a row's tokens has its last token
            out = jnp.where((block_len > 0)[:, None, None], logits, out)
        else:  # written in place: no stacked copy of every block's logits
            out = jax.lax.dynamic_update_slice_in_dim(out, logits, i * blk, axis=1)
        return (c, out), None

    (cache, out), _ = jax.lax.scan(step, (cache, out), (jnp.arange(n), blocks, block_lens))
    return (out if last_only else out[:, :T]), cache


def _forward_chunk(params, cfg: ModelConfig, tokens, cache, lens, last_only: bool = False):
    """One chunk through the cache, as its kind lays it out and plans its attention."""
    rows = jnp.maximum(lens - 1, 0)[:, None] if last_only else None
    lay = cache.kind.layout(cache, lens, tokens.shape[1])
    logits, (ks, vs, state) = Transformer(cfg).apply({"params": params}, tokens, cache, lay,
                                                     None, rows)
    return cache.kind.advance(cache, lay, logits, ks, vs, state)


# ---- a chunk through the cache in parts: the embedding, each layer, the head -----------------
# What _forward_chunk computes, as separate traceable parts that a caller jits one by one (the
# chat's prompt, jaxllm.generate.feed_by_layer): one layer's program run for every layer instead
# of one program holding every layer: a loaded program's size grows with its layers (why and
# what it saves: docs/CPU.md, "A layer at a time"). The embedding's part
# also makes the chunk's attention plan, which every layer's part takes (split_static); the
# cache's counters stay as they were until the head's part advances them.

def embed_part(params, cfg: ModelConfig, tokens: Int[Array, "b t"], cache: kvc.KVCache,
               lens: Int[Array, " b"]) -> tuple[Float[Array, "b t d"], attention.Plan]:
    """The first block's input for ``tokens`` fed into ``cache``, and the layers' plan (the
    cache's keys and values are only looked at for their shapes: any one layer's serve)."""
    B, T = tokens.shape
    lay = cache.kind.layout(cache, lens, T)
    x = Transformer(cfg).apply({"params": params}, tokens, cache, lay, part="embed")
    return x, chunk_plan(cfg, cache, lay, B, T)


def cache_plan(cfg: ModelConfig, cache: kvc.KVCache, lens: Int[Array, " b"],
               T: int) -> attention.Plan:
    """The plan of a chunk of ``T`` tokens (``lens`` valid) through ``cache``."""
    return chunk_plan(cfg, cache, cache.kind.layout(cache, lens, T), cache.batch, T)


def layer_view(cache: kvc.KVCache, layer: int) -> kvc.KVCache:
    """``cache`` with one layer's keys, values and state."""
    return cache.replace(k=(cache.k[layer],), v=(cache.v[layer],),
                         state=cache.state[layer:layer + 1])


def layer_part(layer_params, cfg: ModelConfig, x: Float[Array, "b t d"], layer_cache: tuple,
               plan: attention.Plan) -> tuple[Float[Array, "b t d"], tuple]:
    """One block on the chunk: its output and the layer's new (keys, values) + state, from
    the layer's (keys, values) + state before the chunk."""
    return Block(cfg).apply({"params": layer_params}, x, layer_cache, plan)


def head_part(params, cfg: ModelConfig, x: Float[Array, "b t d"], cache: kvc.KVCache,
              lens: Int[Array, " b"], last_only: bool = False):
    """The logits and the cache after the chunk, from the last block's output ``x`` and
    ``cache`` holding every layer's new keys, values and state (its counters still those
    before the chunk): as :func:`apply` returns them."""
    rows = jnp.maximum(lens - 1, 0)[:, None] if last_only else None
    lay = cache.kind.layout(cache, lens, x.shape[1])
    logits = Transformer(cfg).apply({"params": params}, x, cache, lay, None, rows, part="head")
    return cache.kind.advance(cache, lay, logits, cache.k, cache.v, cache.state)


def apply_by_layer(params, cfg: ModelConfig, tokens: Int[Array, "b t"], cache: kvc.KVCache,
                   lens: Int[Array, " b"], last_only: bool = False):
    """:func:`apply`'s ``(logits, cache)`` for a chunk through ``cache``, from one program per
    part, run from the host: the embedding (and the chunk's attention plan), one layer's
    program called for each layer in turn, and the head. Its programs hold one layer where a
    program around :func:`apply` holds them all (less memory once loaded; docs/CPU.md, "A layer
    at a time"); the cost is a call a layer. Not for use
    inside a jit. The cache is donated (use the one returned). Parameters with the blocks
    stacked, and a chunk that the kind would feed in blocks, go through :func:`apply` in one
    program."""
    T = tokens.shape[1]
    blk = cache.kind.prefill_block(cache.batch)
    if "layers" in params or (blk is not None and T > blk):
        return _apply_donating(params, cfg, tokens, cache, lens, last_only)
    ends = {k: v for k, v in params.items() if not k.startswith("layer_")}
    view = layer_view(cache, 0)
    static = _plan_static(cfg, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                            (view, lens)), T)
    x, plan = _embed_jit(ends, cfg, tokens, view, lens)
    layers = []
    for i in range(cfg.num_layers):
        layer_cache = (cache.k[i], cache.v[i]) + cache.state[i:i + 1]
        x, new = _layer_jit(params[f"layer_{i}"], cfg, static, x, layer_cache, plan)
        layers.append(new)
    cache = cache.replace(k=tuple(n[0] for n in layers), v=tuple(n[1] for n in layers),
                          state=tuple(s for n in layers for s in n[2:]))
    return _head_jit(ends, cfg, x, cache, lens, last_only)


@functools.lru_cache(maxsize=64)
def _plan_static(cfg: ModelConfig, abstract: tuple, T: int) -> tuple:
    """The static part (split_static) of the plan whose arrays :func:`_embed_jit` returns, for
    ``abstract``: (a layer's view, lens) as shapes and dtypes."""
    out = []

    def plan(view, lens):
        arrays, static = split_static(cache_plan(cfg, view, lens, T))
        out.append(static)
        return arrays
    jax.eval_shape(plan, *abstract)
    return out[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed_jit(params, cfg: ModelConfig, tokens, view: kvc.KVCache, lens):
    x, plan = embed_part(params, cfg, tokens, view, lens)
    return x, split_static(plan)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "static"), donate_argnames=("layer_cache",))
def _layer_jit(layer_params, cfg: ModelConfig, static: tuple, x, layer_cache: tuple, plan: list):
    # The layer's keys, values and state donated: its write is in place.
    return layer_part(layer_params, cfg, x, layer_cache, join_static(static, plan))


@functools.partial(jax.jit, static_argnames=("cfg", "last_only"), donate_argnames=("cache",))
def _head_jit(params, cfg: ModelConfig, x, cache: kvc.KVCache, lens, last_only: bool):
    return head_part(params, cfg, x, cache, lens, last_only)


@functools.partial(jax.jit, static_argnames=("cfg", "last_only"), donate_argnames=("cache",))
def _apply_donating(params, cfg: ModelConfig, tokens, cache, lens, last_only: bool):
    return apply(params, cfg, tokens, cache, lens, last_only=last_only)


_forward_jit = jax.jit(apply, static_argnames=("cfg",))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_token_ids(cfg: ModelConfig, tokens) -> None:
    """Token ids must index the embedding (``embed_rows``: the vocabulary, plus a learnable
    sink's row). Out-of-range ids would be clamped silently by the gather; under a caller's own
    jit they are (the check needs concrete values), so check before jitting."""
    ids = np.asarray(jax.device_get(tokens))
    bad = (ids < 0) | (ids >= cfg.embed_rows)
    if bad.any():
        b, t = map(int, np.argwhere(bad)[0])
        raise ValueError(f"token id {int(ids[b, t])} at row {b}, position {t} is outside the "
                         f"model's vocabulary [0, {cfg.embed_rows}); does the tokenizer match the "
                         f"model? ({int(bad.sum())} bad ids in all)")


def check_chunk(cfg: ModelConfig, tokens, cache: Optional[kvc.KVCache], lengths) -> jax.Array:
    """Validate a forward call's inputs; returns per-row valid lengths [B] (int32)."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    B, T = tokens.shape
    if T == 0:
        raise ValueError("the chunk is empty (tokens of shape [batch, 0]): pass at least one token")
    if _is_concrete(tokens):
        check_token_ids(cfg, tokens)
    if lengths is None:
        lens = jnp.full((B,), T, jnp.int32)
    else:
        lens = jnp.asarray(lengths, jnp.int32)
        if lens.shape != (B,):
            raise ValueError(f"lengths must have shape [batch]=({B},), got {tuple(lens.shape)}")
        if _is_concrete(lens):
            lo, hi = int(lens.min()), int(lens.max())
            if lo < 0 or hi > T:
                raise ValueError(f"lengths must lie in [0, {T}] (valid tokens per row of this "
                                 f"chunk), got values in [{lo}, {hi}]")
    if cache is None:
        check_positions(cfg, T)
    else:
        check_positions(cfg, cache.capacity, streams=cache.kind.streams or cache.sinks > 0)
    if cache is None:
        if lengths is not None:
            raise ValueError("lengths (right padding) only applies to a forward with a cache; "
                             "a plain causal forward is unaffected by trailing padding")
        return lens
    if cache.batch != B:
        raise ValueError(f"tokens have batch {B} but the cache was made for batch {cache.batch}; "
                         f"use init_cache(cfg, batch={B}, ...)")
    kv_shape = cache.k[0].shape
    if (kv_shape[1], kv_shape[3]) != (cfg.num_kv_heads, cfg.head_dim) or \
            len(cache.k) != cfg.num_layers:
        raise ValueError("the cache does not match this ModelConfig (layers/kv heads/head dim); "
                         "make it with init_cache(cfg, ...) for the same cfg")
    if cache.keys_rotated and not kvc.rotates_keys(cfg):
        raise ValueError("the cache stores its keys rotated (a RoPE model with fixed "
                         "frequencies) but this ModelConfig's positions differ; make it with "
                         "init_cache(cfg, ...) for the same cfg")
    if _is_concrete(cache.length) and _is_concrete(lens):
        cache.kind.check_room(cache, jax.device_get(cache.length + lens))
    return lens


def forward(params, cfg: ModelConfig, tokens: Int[Array, "b t"],
            cache: Optional[kvc.KVCache] = None, lengths: Optional[Int[Array, " b"]] = None,
            positions: Optional[Int[Array, "b t"]] = None
            ) -> tuple[Float[Array, "b t v"], Optional[kvc.KVCache]]:
    """Logits for ``tokens`` and the updated cache.

    ``cache=None``: a plain causal forward at positions 0..T-1 (the cache returned is None).
    With a cache: the chunk (any length, also longer than the window) continues each row's
    stream; ``lengths`` [B] marks how many leading tokens of each row are real (the rest is padding,
    never written, with undefined logits). Every token's logits equal those of feeding the stream
    one token at a time through a cache trimmed to S+W after each token.
    ``positions`` [B, T] (plain forward only): explicit position ids, strictly increasing along
    each row (training with skipped positions, PoSE); attention stays causal in token order.
    """
    tokens = jnp.asarray(tokens)
    lens = check_chunk(cfg, tokens, cache, lengths)
    if positions is None:
        return _forward_jit(params, cfg, tokens.astype(jnp.int32), cache, lens)
    positions = check_positions_arg(cfg, tokens, cache, positions)
    return _forward_positions_jit(params, cfg, tokens.astype(jnp.int32), positions)


_forward_positions_jit = jax.jit(lambda p, cfg, t, pos: apply(p, cfg, t, positions=pos),
                                 static_argnums=1)


def check_positions_arg(cfg: ModelConfig, tokens, cache, positions) -> jax.Array:
    """Explicit positions: a plain forward only, [B, T] integers, non-negative, strictly
    increasing along each row, and within a learned position table."""
    if cache is not None:
        raise ValueError("positions apply to a plain forward (cache=None); a cache assigns "
                         "positions within itself")
    pos = jnp.asarray(positions)
    if pos.shape != tokens.shape or not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"positions must be integers of the tokens' shape {tuple(tokens.shape)},"
                         f" got {pos.dtype} {tuple(pos.shape)}")
    if _is_concrete(pos):
        p = np.asarray(pos)
        if (p < 0).any() or (np.diff(p, axis=1) <= 0).any():
            raise ValueError("positions must be >= 0 and strictly increasing along each row")
        check_positions(cfg, int(p.max()) + 1)
    return pos.astype(jnp.int32)
