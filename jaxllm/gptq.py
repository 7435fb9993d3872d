"""GPTQ ("GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
Frantar et al., ICLR 2023, Algorithm 1) and round-to-nearest (RTN), into the low-bit layout of
jaxllm.lowbit.

Per linear, from calibration inputs X (tokens x in): H = 2·XᵀX / n (dead columns, H_ii = 0, get
H_ii = 1 and a zero weight column), dampened by ``damp``·mean(diag H), and the upper Cholesky
factor U of H⁻¹. Columns are quantized in order; column j's error, divided by U_jj, is spread
over the columns after it along U's row j (eq. 3 with the Cholesky form, Section 3.3), applied
lazily: within a block of columns at once, to the rest after the block (Section 3.2, "Lazy
Batch-Updates"). The quantizer is the authors': per row (and group of G columns), asymmetric
xmin = min(w, 0), xmax = max(w, 0), scale = (xmax - xmin)/maxq, zero = round(-xmin/scale) (both
0: ±1), code = clamp(round(w/scale) + zero, 0, maxq), ŵ = scale·(code - zero); symmetric: zero =
(maxq + 1)/2 over ±max|w|. A group's parameters are fitted when its first column is reached, on
the columns as updated so far (blocks are whole groups, so the update is complete there), or
with ``act_order`` (columns in order of decreasing H_ii) fixed up front per group in the
original column order ("static groups"), so inference needs no per-column group index.

RTN is the same quantizer on the weights as they are. Blocks of the model are quantized in
order, each calibrated on the outputs of the blocks before it as already quantized
(:func:`quantize_model`); ``true_sequential`` also orders the linears inside a block
({q, k, v}, o, {up, gate}, down), each calibrated after the ones before it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from . import lowbit


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """``method``: gptq | rtn; ``group``: input columns per scale (0: per output channel);
    ``block``: columns per lazy batch (rounded up to whole groups)."""

    method: str = "gptq"
    bits: int = 4
    group: int = 128
    sym: bool = False
    act_order: bool = False
    damp: float = 0.01
    block: int = 128
    true_sequential: bool = False

    def __post_init__(self):
        if self.method not in ("gptq", "rtn"):
            raise ValueError(f"method must be gptq or rtn, got {self.method!r}")
        if self.bits not in lowbit.BITS:
            raise ValueError(f"bits {self.bits} is not supported; choose one of "
                             f"{', '.join(map(str, lowbit.BITS))}")
        if self.group < 0:
            raise ValueError(f"group must be >= 0 (0: per output channel), got {self.group}")
        if not 0 <= self.damp < 1:
            raise ValueError(f"damp must lie in [0, 1), got {self.damp}")
        if self.method == "rtn" and (self.act_order or self.true_sequential):
            raise ValueError("act_order and true_sequential apply to GPTQ only (rtn uses no "
                             "calibration)")

    def group_of(self, in_features: int) -> int:
        return self.group or in_features


def _grid(w: Float[Array, "o n"], ok, bits: int, sym: bool):
    """The authors' per-row quantizer over the columns ``ok`` [n] of w: (scale, zero) [out]."""
    maxq = 2 ** bits - 1
    big = jnp.asarray(jnp.finfo(w.dtype).max, w.dtype)
    xmin = jnp.minimum(jnp.min(jnp.where(ok, w, big), axis=1), 0)
    xmax = jnp.maximum(jnp.max(jnp.where(ok, w, -big), axis=1), 0)
    if sym:
        xmax = jnp.maximum(-xmin, xmax)
        xmin = jnp.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin, xmax = jnp.where(both0, -1, xmin), jnp.where(both0, 1, xmax)
    scale = (xmax - xmin) / maxq
    zero = jnp.full_like(scale, (maxq + 1) / 2) if sym else jnp.round(-xmin / scale)
    return scale, zero


def _quant(w, scale, zero, bits: int):
    """(code, ŵ) of a column w [out] under per-row (scale, zero)."""
    code = jnp.clip(jnp.round(w / scale) + zero, 0, 2 ** bits - 1)
    return code, scale * (code - zero)


@functools.partial(jax.jit, static_argnames=("cfg",))
def rtn_layer(w: Float[Array, "o i"], cfg: GPTQConfig):
    """Round-to-nearest with the same grid: (codes [out, in], scale, zero [out, groups])."""
    out, n = w.shape
    G = cfg.group_of(n)
    cols = jnp.arange(n)
    grids = [_grid(w, (cols >= g * G) & (cols < (g + 1) * G), cfg.bits, cfg.sym)
             for g in range(lowbit.n_groups(G, n))]
    scale, zero = (jnp.stack(x, axis=1) for x in zip(*grids))
    code, _ = _quant(w, lowbit.expand(scale, G, n), lowbit.expand(zero, G, n), cfg.bits)
    return code, scale, zero


@functools.partial(jax.jit, static_argnames=("cfg",))
def gptq_layer(w: Float[Array, "o i"], H: Float[Array, "i i"], cfg: GPTQConfig):
    """GPTQ of one linear's K-major weight w [out, in] with Hessian H [in, in]: (codes
    [out, in], scale, zero [out, groups], loss), codes in the original column order. Runs in
    w's dtype (float64 under jax's x64 mode: the tests' exact comparison)."""
    out, n = w.shape
    G = cfg.group_of(n)
    B = -(-max(cfg.block, G) // G) * G if cfg.group else cfg.block  # whole groups per block
    dead = jnp.diagonal(H) == 0
    H = H + jnp.diag(dead.astype(H.dtype))
    w = jnp.where(dead[None, :], 0, w)
    cols = jnp.arange(n)
    fixed = None
    if cfg.act_order or not cfg.group:  # parameters fixed up front, per original group
        grids = [_grid(w, (cols >= g * G) & (cols < (g + 1) * G), cfg.bits, cfg.sym)
                 for g in range(lowbit.n_groups(G, n))]
        fixed = tuple(jnp.stack(x, axis=1) for x in zip(*grids))  # [out, groups] each
    perm = jnp.argsort(-jnp.diagonal(H), stable=True) if cfg.act_order else cols
    w, H = w[:, perm], H[perm][:, perm]
    H = H + cfg.damp * jnp.mean(jnp.diagonal(H)) * jnp.eye(n, dtype=H.dtype)
    U = jnp.linalg.cholesky(jnp.linalg.inv(H)).T  # upper: H⁻¹ = Uᵀ U
    # Group parameters as each column (in quantization order) uses them.
    codes = jnp.zeros((out, n), w.dtype)
    scales = jnp.zeros((out, lowbit.n_groups(G, n)), w.dtype)
    zeros = jnp.zeros_like(scales)
    loss = jnp.zeros((), w.dtype)
    for i1 in range(0, n, B):
        i2 = min(i1 + B, n)
        W1, U1 = w[:, i1:i2], U[i1:i2, i1:i2]
        E1 = jnp.zeros_like(W1)
        bcols = jnp.arange(i2 - i1)

        def column(j, carry, i1=i1, U1=U1, W0=W1):
            W1, E1, codes, scales, zeros, loss, sc, ze = carry
            col = i1 + j  # position in quantization order
            if fixed is not None:
                g = perm[col] // G
                sc, ze = fixed[0][:, g], fixed[1][:, g]
            else:  # a new group starts: fit it on its columns as they stood when this lazy
                # block began (W0), as the authors' fasterquant does; within a block the
                # columns have taken the updates of the group before (a block of two groups
                # gave 19% other codes fitted on those, docs/METHODS.md §7)
                start = (col % G) == 0
                in_group = (bcols >= j) & (bcols < j + G)
                s2, z2 = _grid(W0, in_group, cfg.bits, cfg.sym)
                sc, ze = jnp.where(start, s2, sc), jnp.where(start, z2, ze)
                g = col // G
                scales = jnp.where(start, scales.at[:, g].set(s2), scales)
                zeros = jnp.where(start, zeros.at[:, g].set(z2), zeros)
            wj = W1[:, j]
            code, q = _quant(wj, sc, ze, cfg.bits)
            d = U1[j, j]
            err = (wj - q) / d
            loss = loss + jnp.sum((wj - q) ** 2) / d ** 2 / 2
            after = (bcols > j).astype(W1.dtype)
            W1 = W1 - err[:, None] * (U1[j] * after)[None, :]
            E1 = E1.at[:, j].set(err)
            codes = codes.at[:, col].set(code)
            return W1, E1, codes, scales, zeros, loss, sc, ze

        zero_col = jnp.zeros((out,), w.dtype)
        W1, E1, codes, scales, zeros, loss, _, _ = jax.lax.fori_loop(
            0, i2 - i1, column, (W1, E1, codes, scales, zeros, loss, zero_col, zero_col))
        w = w.at[:, i2:].add(-E1 @ U[i1:i2, i2:])
    inv = jnp.argsort(perm)
    codes = codes[:, inv]
    if fixed is not None:
        scales, zeros = fixed
    return codes, scales, zeros, loss


def to_node(codes, scale, zero, cfg: GPTQConfig, in_features: int) -> lowbit.QLowBit:
    """The layout's node: offset = -scale·zero (ŵ = code·scale + offset)."""
    return lowbit.encode(codes, scale, -scale * zero, cfg.bits, cfg.group_of(in_features))


def quantize_linear(kernel: Float[Array, "i o"], cfg: GPTQConfig,
                    H: Optional[Float[Array, "i i"]] = None):
    """A float kernel [in, out] (as Linear stores it) -> (QLowBit, loss or None)."""
    w = jnp.asarray(kernel, jnp.float32).T  # [out, in]
    n = w.shape[1]
    lowbit.check(cfg.bits, cfg.group_of(n), n)
    if cfg.method == "rtn":
        codes, scale, zero = rtn_layer(w, cfg)
        return to_node(codes, scale, zero, cfg, n), None
    codes, scale, zero, loss = gptq_layer(w, jnp.asarray(H, jnp.float32), cfg)
    return to_node(codes, scale, zero, cfg, n), float(loss)


def hessian(x: Float[Array, "n i"]) -> Float[Array, "i i"]:
    """2·XᵀX over the rows (tokens) of x, unnormalised: :class:`Hessians` divides by n."""
    x = x.astype(jnp.float32)
    return 2.0 * (x.T @ x)


def output_error(kernel, node: lowbit.QLowBit, x) -> float:
    """‖W X - Ŵ X‖² over calibration inputs x [n, in] (the layer-wise objective, eq. 1)."""
    w = np.asarray(kernel, np.float64)  # [in, out]
    xq = np.asarray(x, np.float64)
    return float(np.sum((xq @ w - xq @ lowbit.numpy_dequantize(node).T) ** 2))


# ---- the model, block by block --------------------------------------------------------------
STAGES = (("attn/q", "attn/k", "attn/v"), ("attn/o",), ("mlp/up", "mlp/gate"), ("mlp/down",))


def _stages(names: list[str], true_sequential: bool) -> list[list[str]]:
    """The block's linears in calibration order: all at once, or the authors' true-sequential
    order ({q, k, v}, o, {up, gate}, down; any other linear last)."""
    if not true_sequential:
        return [names]
    known = [[n for n in stage if n in names] for stage in STAGES]
    rest = [n for n in names if not any(n in s for s in STAGES)]
    return [s for s in known + [rest] if s]


def quantize_model(params, cfg, tokens: np.ndarray, qcfg: GPTQConfig, batch: int = 4,
                   progress: bool = False, int8_embedding: bool = True):
    """Every linear of every block as a jaxllm.lowbit.QLowBit, block after block, each
    calibrated on what the quantized blocks before it output; ``int8_embedding``: the embedding
    table (and so a tied head) int8 with one scale per row, weight-only (quant.quantize_rows),
    else float as loaded; an untied head and the norms stay float. ``tokens`` [n, L]:
    calibration sequences (RTN reads none). Returns (params, info): per linear its GPTQ loss and
    ‖WX - ŴX‖² against RTN's (on the calibration inputs)."""
    from . import tree
    from .model import apply, block_apply
    from .quant import is_quantized
    if is_quantized(params):
        raise ValueError("these params are already quantized; GPTQ and RTN start from float "
                         "weights (quantizing quantized weights compounds the rounding)")
    flat = tree.flatten(params)
    out = dict(flat)
    info = {"method": qcfg.method, "bits": qcfg.bits, "group": qcfg.group, "sym": qcfg.sym,
            "act_order": qcfg.act_order, "layers": {}}
    xs = []
    # One compiled program each, reused by every batch and block (the blocks share shapes).
    first = jax.jit(functools.partial(apply, cfg=cfg, mutable=("block_inputs",),
                                      last_only=True))
    inputs = jax.jit(functools.partial(block_apply, cfg=cfg, mutable=("inputs",)))
    forward = jax.jit(functools.partial(block_apply, cfg=cfg))
    if qcfg.method == "gptq":  # the first block's input, per calibration batch
        for i in range(0, len(tokens), batch):
            xs.append(first(params, tokens=jnp.asarray(tokens[i:i + batch]))[2][
                "block_inputs"]["x"])
    from .progress import bar
    with bar(total=cfg.num_layers, desc=f"{qcfg.method} {qcfg.bits}-bit", unit="block",
             disable=not progress) as blocks:
        for layer in range(cfg.num_layers):
            xs = _quantize_block(layer, out, xs, qcfg, inputs, forward, info["layers"])
            blocks.update(1)
    if int8_embedding and "embed/embedding" in out:
        from .quant import quantize_rows
        out["embed/embedding"] = quantize_rows(jnp.asarray(out["embed/embedding"]), act="none")
    q = tree.unflatten(out)
    nodes = [v for v in out.values() if isinstance(v, lowbit.QLowBit)]
    info["linear_bytes"] = sum(v.nbytes for v in nodes)
    info["float_linear_bytes"] = sum(4 * v.shape[0] * v.shape[1] for v in nodes)
    info["other_bytes"] = sum(sum(x.nbytes for x in jax.tree.leaves(v))
                              for v in out.values() if not isinstance(v, lowbit.QLowBit))
    return q, info


def _quantize_block(layer: int, out: dict, xs: list, qcfg: GPTQConfig, inputs, forward,
                    losses: dict) -> list:
    """Block ``layer``'s linears quantized in ``out`` (flat params, updated in place), each
    stage on its inputs with the block's earlier stages quantized, their losses in ``losses``;
    returns the next block's inputs (GPTQ)."""
    from . import tree
    prefix = f"layer_{layer}/"
    lp = tree.unflatten({k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)})
    names = [k[:-len("/kernel")] for k in tree.flatten(lp) if k.endswith("/kernel")]
    for stage in _stages(names, qcfg.true_sequential):
        H = {n: 0.0 for n in stage}
        count = 0
        for x in xs:  # the stage's inputs, with the block's earlier stages quantized
            _, st = inputs(lp, x=x)
            for n in stage:
                xin = tree.flatten(st["inputs"])[f"{n}/x"]
                H[n] = H[n] + hessian(xin)
            count += x.shape[0] * x.shape[1]
        flat_lp = tree.flatten(lp)
        for n in stage:
            kernel = flat_lp[f"{n}/kernel"]
            node, loss = quantize_linear(kernel, qcfg, H[n] / max(count, 1)
                                         if qcfg.method == "gptq" else None)
            flat_lp[f"{n}/kernel"] = node
            losses[prefix + n] = {"loss": loss}
        lp = tree.unflatten(flat_lp)
    if qcfg.method == "gptq":
        xs = [forward(lp, x=x) for x in xs]  # the next block's input
    for k, v in tree.flatten(lp).items():
        out[prefix + k] = v
    return xs
