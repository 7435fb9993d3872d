"""SmoothQuant W8A8 (Xiao et al. 2023; docs/METHODS.md §3): calibration, smoothing, quantization.

1. **Calibrate**: run the float model over calibration text and record, for the input of every
   linear layer, the per-channel max |X_j| (per-tensor statistics are their max).
2. **Smooth** (eq. 4): Y = (X diag(s)^-1)(diag(s) W) with s_j = max|X_j|^α / max|W_j|^(1-α),
   W_j the j-th input row of every linear reading X (q/k/v together; up, or gate and up, together).
   1/s folds into the preceding norm's scale and bias, s into those linears' rows, offline; the
   float function is unchanged. Optionally (SwiGLU) down's input is smoothed through up.
3. **Quantize** every linear (and the embedding table, per row) to int8 :class:`QKernel` leaves.
   Schemes (Table 2 of the paper): ``o1`` W per-tensor + A per-token dynamic; ``o2`` W per-tensor
   + A per-tensor dynamic; ``o3`` W per-tensor + A per-tensor static (calibrated); ``w8``
   weight-only per-channel. The output head always uses per-channel weights and per-token
   dynamic activations (it reads no smoothed input, and logits are the most sensitive output).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import pages, tree
from .config import ModelConfig
from .model import apply, init_params
from .quant import QMAX, QAttention, QKernel, is_quantized, quantize_rows, quantize_weight

# scheme -> (weights per channel?, activation mode)
SCHEMES = {"o1": (False, "token"), "o2": (False, "tensor"), "o3": (False, "static"),
           "w8": (True, "none")}
# Migration strength per family: the paper's values where it gives them (OPT 0.5, Llama/Mistral
# 0.8-0.85, Falcon 0.6-0.7); 0.5, its general default, elsewhere. alpha="auto" searches instead.
DEFAULT_ALPHA = {"opt": 0.5, "llama": 0.85, "mistral": 0.8, "falcon": 0.6, "gpt_neox": 0.5,
                 "mpt": 0.5}
AUTO_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
# The paper's alphas were found on models of 6.7B parameters and more (OPT-6.7B to 175B, Llama
# 7B-65B, Falcon 7B-40B, Mistral-7B; SmoothQuant §5, Table 7), whose outlier channels reach
# 100x the rest. A smaller model of the same family has no paper value: there the CLI searches.
PAPER_MIN_PARAMS = 6e9


def paper_alpha(cfg: ModelConfig) -> Optional[float]:
    """The paper's migration strength for this model: its family's value for a model in the
    paper's size range, else None (no paper value: search with alpha="auto")."""
    shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    return DEFAULT_ALPHA.get(cfg.family) if n >= PAPER_MIN_PARAMS else None


@dataclasses.dataclass(frozen=True)
class CalibConfig:
    """How much calibration text to use (the paper: 512 random sequences of 512 tokens)."""

    n_seqs: int = 512
    seq_len: int = 512
    batch: int = 8
    heldout_seqs: int = 8  # for alpha="auto": scored on text kept out of the statistics
    seed: int = 0


# ---- calibration --------------------------------------------------------------------------------

def calibration_windows(ids: np.ndarray, cc: CalibConfig, auto: bool
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Random windows for statistics, and (for auto) held-out windows from the tail."""
    need_held = cc.heldout_seqs * cc.seq_len if auto else 0
    if len(ids) < cc.seq_len + need_held:
        raise ValueError(f"calibration text too short: {len(ids)} tokens, but one "
                         f"{cc.seq_len}-token sequence{' plus the held-out ' if auto else ''}"
                         f"{need_held if auto else ''}{' tokens' if auto else ''} is needed; give "
                         f"more text or a smaller seq_len")
    body, held = (ids[:len(ids) - need_held], ids[len(ids) - need_held:]) if auto else (ids, ids[:0])
    starts = np.random.default_rng(cc.seed).integers(0, len(body) - cc.seq_len + 1, cc.n_seqs)
    calib = np.stack([body[s:s + cc.seq_len] for s in starts])
    return calib, held.reshape(-1, cc.seq_len) if auto else held


@functools.partial(jax.jit, static_argnames=("cfg",))
def _absmax_batch(params, cfg: ModelConfig, tokens):
    _, _, state = apply(params, cfg, tokens, mutable=["intermediates"])
    return state["intermediates"]


def calibrate(params, cfg: ModelConfig, tokens: np.ndarray, progress: bool = False) -> dict:
    """Per-channel max |input| of every linear layer over ``tokens`` [N, L]: ``{path: [in]}``
    with paths like ``"layer_0/attn/q"``."""
    stats = None
    it = range(0, len(tokens), 8)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="calibrate", unit="batch")
    for i in it:
        got = _absmax_batch(params, cfg, jnp.asarray(tokens[i:i + 8], jnp.int32))
        stats = got if stats is None else jax.tree.map(jnp.maximum, stats, got)
    suffix = "/in_absmax"  # what Linear sows, under the layer's path
    return {path[:-len(suffix)]: np.asarray(v)
            for path, v in tree.flatten(jax.device_get(stats)).items() if path.endswith(suffix)}


# ---- smoothing ----------------------------------------------------------------------------------

def smooth_groups(cfg: ModelConfig, smooth_down: bool = False) -> list[tuple[str, list[str]]]:
    """(norm, linears reading its output) per block: the places smoothing folds into."""
    if not cfg.pre_norm:
        raise ValueError(f"smoothing folds 1/s into the norm before each linear, but this "
                         f"{cfg.family} model normalises after the residual (post-LN); quantize "
                         f"it without smoothing (smooth=False)")
    groups = []
    for i in range(cfg.num_layers):
        L = f"layer_{i}"
        attn = [f"{L}/attn/{n}" for n in ("q", "k", "v")]
        mlp = [f"{L}/mlp/up"] + ([f"{L}/mlp/gate"] if cfg.mlp == "swiglu" else [])
        if cfg.shared_norm:
            groups.append((f"{L}/ln_attn", attn + mlp))
        else:
            groups += [(f"{L}/ln_attn", attn), (f"{L}/ln_mlp", mlp)]
        if smooth_down:
            if cfg.mlp != "swiglu":
                raise ValueError("smooth_down needs a SwiGLU MLP (down's input is then linear in "
                                 "up's output)")
            groups.append((f"{L}/mlp/up#out", [f"{L}/mlp/down"]))
    return groups


def smoothing_factors(params, stats: dict, groups, alpha: float) -> dict:
    """s per group (eq. 4), clamped to >= 1e-5 as the reference implementation does."""
    out = {}
    for norm, linears in groups:
        x_max = np.maximum(stats[linears[0]], 1e-5)
        w_max = np.max([np.abs(np.asarray(tree.get(params, f"{lin}/kernel"))).max(axis=1)
                        for lin in linears], axis=0)
        out[norm] = np.maximum(x_max ** alpha / np.maximum(w_max, 1e-5) ** (1 - alpha), 1e-5)
    return out


def apply_smoothing(params, groups, factors: dict):
    """Fold 1/s into each group's norm (or up's output columns) and s into its linears' rows."""
    params = jax.tree.map(np.array, jax.device_get(params))  # copies: the input stays intact
    for norm, linears in groups:
        s = factors[norm].astype(np.float32)
        if norm.endswith("#out"):  # down's input = act(gate) * up: scale up's output columns
            up = tree.get(params, norm[:-4])
            up["kernel"] = up["kernel"] / s
            if "bias" in up:
                up["bias"] = up["bias"] / s
        else:
            n = tree.get(params, norm)
            n["scale"] = n["scale"] / s
            if "bias" in n:
                n["bias"] = n["bias"] / s
        for lin in linears:
            node = tree.get(params, lin)
            node["kernel"] = node["kernel"] * s[:, None]
    return params


def add_outlier_channels(params, cfg: ModelConfig, channels, gain: float = 100.0):
    """LLM-like activation outliers for studies (SmoothQuant §3: ~100x the typical magnitude) on
    ``channels`` of every norm output, the float function unchanged: smoothing run backwards, with
    s = 1/gain on those channels (norm gains x gain, the reading rows / gain)."""
    groups = smooth_groups(cfg)
    s = np.ones(cfg.hidden_size, np.float32)
    s[list(channels)] = 1.0 / gain
    return jax.tree.map(jnp.asarray, apply_smoothing(params, groups, {n: s for n, _ in groups}))


# ---- quantization -------------------------------------------------------------------------------

def _linear_paths(params) -> list[str]:
    """Paths of the modules holding a ``kernel`` (the linear layers and the head)."""
    return [path[:-len("/kernel")] for path in tree.flatten(params) if path.endswith("/kernel")]


def _check_embedding_head(cfg: ModelConfig, quantize_embedding: bool, quantize_head: bool):
    if cfg.tie_embeddings and quantize_embedding != quantize_head:
        raise ValueError("this model ties its output head to the embedding table (one tensor), so "
                         "quantize_embedding and quantize_head must agree")


def quantize_params(params, cfg: ModelConfig, scheme: str, stats: Optional[dict] = None,
                    real: bool = True, int8_attention: bool = False, per_channel: Optional[bool] = None,
                    quantize_embedding: bool = True, quantize_head: bool = True):
    """Every linear kernel (and the embedding table) of already smoothed float params as int8.
    ``stats``: smoothed per-channel input maxima, needed by the static scheme ``o3``.
    ``quantize_embedding`` / ``quantize_head=False`` keep those in float (the SmoothQuant
    authors' setting)."""
    _check_embedding_head(cfg, quantize_embedding, quantize_head)
    scheme_channel, act = SCHEMES[scheme]
    per_channel = scheme_channel if per_channel is None else per_channel
    out = jax.tree.map(np.asarray, jax.device_get(params))  # a fresh tree to fill in
    for path in _linear_paths(out):
        node = tree.get(out, path)
        w = jnp.asarray(node["kernel"])
        if path == "lm_head":  # the head: per-channel weights, per-token activations
            if quantize_head:
                node["kernel"] = quantize_weight(w, True, "none" if act == "none" else "token",
                                                 real=real)
            continue
        a_scale = None
        if act == "static":
            a_scale = float(np.max(stats[path])) / QMAX
        node["kernel"] = quantize_weight(w, per_channel, act, a_scale, real=real)
    if int8_attention:
        for i in range(cfg.num_layers):
            out[f"layer_{i}"]["attn"]["int8_attention"] = QAttention(real=real)
    if quantize_embedding:
        emb = out["embed"]
        emb["embedding"] = quantize_rows(jnp.asarray(emb["embedding"]),
                                         "none" if act == "none" else "token", real=real)
    return jax.tree.map(jnp.asarray, out)  # QAttention has no leaves: kept as is


def _smoothed_stats(stats: dict, groups, factors: dict) -> dict:
    """Input maxima after smoothing: channel j of a smoothed input is divided by s_j."""
    out = dict(stats)
    for norm, linears in groups:
        for lin in linears:
            out[lin] = stats[lin] / factors[norm]
    return out


def quantize(params, cfg: ModelConfig, calib_tokens, scheme: str = "o1",
             alpha: Union[float, str, None] = None, *, smooth: bool = True,
             smooth_down: bool = False, real: bool = True, int8_attention: bool = False,
             per_channel: Optional[bool] = None, quantize_embedding: bool = True,
             quantize_head: bool = True, calib: CalibConfig = CalibConfig(),
             progress: bool = False, return_info: bool = False):
    """SmoothQuant: calibrate on ``calib_tokens`` (token ids, 1-D stream), smooth with strength
    ``alpha`` (None: the family default; ``"auto"``: grid search on held-out calibration text
    minimising the quantized model's loss) and quantize with ``scheme``; ``int8_attention`` also runs the
    attention products QKᵀ and PV in INT8; ``per_channel`` overrides the scheme's weight
    granularity; ``real=False`` gives fake-quant (float) arithmetic. The embedding table (int8
    per row) and the output head (per-channel W8) are quantized by default;
    ``quantize_embedding`` / ``quantize_head=False`` keep them in float, as the SmoothQuant
    authors do (a tied head follows the embedding: both switches must then agree).

    Returns params that ``forward``/``generate`` take unchanged (with any cache), and with
    ``return_info=True`` also a dict (alpha used, per-alpha held-out loss for ``"auto"``).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if is_quantized(params):
        raise ValueError("these params are already quantized; quantize the float model "
                         "(quantizing int8 weights again would compound the rounding)")
    _check_embedding_head(cfg, quantize_embedding, quantize_head)
    keep = dict(quantize_embedding=quantize_embedding, quantize_head=quantize_head)
    auto = alpha == "auto"
    if alpha is None:
        alpha = DEFAULT_ALPHA.get(cfg.family, 0.5)
    if not auto and not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must lie in [0, 1] or be 'auto', got {alpha!r}")
    ids = np.asarray(calib_tokens, np.int32).reshape(-1)
    calib_ids, held = calibration_windows(ids, calib, auto and smooth)
    stats = calibrate(params, cfg, calib_ids, progress)
    # Smoothing preserves the float function, so one calibration pass serves every alpha (and
    # down's input, act(gate) * up, is the same before and after the other groups' smoothing).
    groups = smooth_groups(cfg, smooth_down) if smooth else []

    def build(a):
        if not smooth:
            return quantize_params(params, cfg, scheme, stats, real, int8_attention, per_channel, **keep)
        factors = smoothing_factors(params, stats, groups, a)
        sm = apply_smoothing(params, groups, factors)
        return quantize_params(sm, cfg, scheme, _smoothed_stats(stats, groups, factors), real,
                               int8_attention, per_channel, **keep)

    info = {"scheme": scheme, "smooth": smooth, "real": real, "int8_attention": int8_attention, **keep}

    def final(q):  # the model returned: its weights on 2 MiB pages, as a load's are
        q = pages.on_huge_pages(q, keep=params)
        return (q, info) if return_info else q

    if not smooth:
        return final(build(None))
    if auto:
        losses = {}
        grid = AUTO_GRID
        if progress:
            from tqdm import tqdm
            grid = tqdm(grid, desc="alpha search", unit="alpha")
        for a in grid:
            losses[a] = heldout_loss(build(a), cfg, held)
        alpha = min(losses, key=losses.get)
        info["losses"] = {str(k): v for k, v in losses.items()}
    info["alpha"] = float(alpha)
    return final(build(alpha))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _nll(params, cfg: ModelConfig, tokens):
    logits, _ = apply(params, cfg, tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def heldout_loss(params, cfg: ModelConfig, tokens: np.ndarray) -> float:
    """Mean next-token NLL over ``tokens`` [N, L] (plain causal forward)."""
    return float(np.mean([_nll(params, cfg, jnp.asarray(tokens[i:i + 4]))
                          for i in range(0, len(tokens), 4)]))
