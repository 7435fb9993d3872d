"""The loss, the optimiser and one sharded training step (with gradient accumulation)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from jaxllm.model import apply, head_logits, init_params, stack_layers
from jaxllm.positions import with_sink

from .config import TrainConfig


def examples(cfg: TrainConfig, batch):
    """Inputs, targets [b, L] and the inputs' positions (None: 0..L-1) from samples of L+1
    tokens, or from PoSE's ``(tokens, positions)`` pairs.

    Learnable sink: the sink token takes position 0 of every sample, so the inputs are
    [sink, x_0 .. x_{L-2}] and the targets x_0 .. x_{L-1}; the sink is never a target (no loss
    on predicting it) and every variant is scored on the same number of positions. With PoSE
    the tokens after the sink move one position up."""
    tokens, pos = batch if isinstance(batch, tuple) else (batch, None)
    if cfg.model.sink_id is not None:
        inputs = with_sink(cfg.model, tokens[:, :-1], keep_length=True)
        if pos is not None:
            pos = jnp.concatenate([jnp.zeros_like(pos[:, :1]), pos[:, :-2] + 1], 1)
        return inputs, tokens[:, :-1], pos
    return tokens[:, :-1], tokens[:, 1:], None if pos is None else pos[:, :-1]


def loss_fn(params, cfg: TrainConfig, batch) -> Float[Array, ""]:
    """Mean next-token cross-entropy (nats) with compute in ``cfg.dtype``, the logits made
    ``cfg.loss_chunk`` tokens at a time."""
    model_cfg = dataclasses.replace(cfg.model, dtype=cfg.dtype, remat=cfg.remat)
    inputs, targets, positions = examples(cfg, batch)
    if not cfg.loss_chunk:
        logits, _ = apply(params, model_cfg, inputs, positions=positions)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()
    x, _ = apply(params, model_cfg, inputs, positions=positions, hidden=True)  # [b, L, d]
    return chunked_cross_entropy(lambda h: head_logits(params, model_cfg, h),
                                 x.reshape(-1, x.shape[-1]), targets.reshape(-1),
                                 cfg.loss_chunk)


def chunked_cross_entropy(head, x: Float[Array, "n d"], targets: Int[Array, " n"],
                          chunk: int) -> Float[Array, ""]:
    """mean(logsumexp(head(x)) - head(x)[target]) over the rows of x, ``chunk`` rows at a
    time: each chunk's logits [chunk, V] are made, reduced and dropped, and made again in the
    backward pass (jax.checkpoint), so neither pass holds the [n, V] logits or their softmax
    (the linear-cross-entropy fusion of Liger-Kernel and of "Cut Your Losses in Large-Vocabulary
    Language Models", Wijmans et al. 2024, here over rows). Padding rows of the last chunk are
    weighted 0."""
    n = x.shape[0]
    c = min(chunk, n)
    k = -(-n // c)
    pad = k * c - n
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(k, c, x.shape[-1])
    ts = jnp.pad(targets, (0, pad)).reshape(k, c)
    ws = (jnp.arange(k * c) < n).reshape(k, c)

    @jax.checkpoint
    def one(total, piece):
        h, t, w = piece
        logits = head(h)  # [c, V] float32
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[:, None], -1)[:, 0]
        return total + jnp.sum(jnp.where(w, lse - picked, 0.0)), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (xs, ts, ws))
    return total / n


def decay_mask(params):
    """Weight decay on matrices (kernels, embeddings), never on biases or norm scales; a
    stacked block's leaves (stack_layers) are judged without their layer axis."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim - (getattr(path[0], "key", None) == "layers") >= 2, params)


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up over ``warmup_frac`` of the steps, cosine decay to ``final_lr_frac``."""
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.steps,
                                              end_value=cfg.lr * cfg.final_lr_frac)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=decay_mask))


def init_state(cfg: TrainConfig, key) -> dict:
    """``{"step", "params" (float32), "opt_state"}``: the whole training state, one pytree."""
    params = init_params(cfg.model, key)
    if cfg.scan_layers:
        params = stack_layers(params)
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": optimizer(cfg).init(params)}


def train_step(state: dict, batch: Int[Array, "b l1"], cfg: TrainConfig):
    """One optimiser step on a global batch [batch_size, seq_len + 1]; the batch is split into
    ``grad_accum`` micro-batches whose gradients are averaged (a scan, so memory is one
    micro-batch's activations). Returns the new state and the metrics."""
    A = cfg.grad_accum
    grad = jax.value_and_grad(loss_fn)
    if A == 1:
        loss, grads = grad(state["params"], cfg, batch)
    else:
        micro = jax.tree.map(lambda b: b.reshape(A, b.shape[0] // A, b.shape[1]), batch)

        def body(acc, mb):
            l, g = grad(state["params"], cfg, mb)
            return jax.tree.map(jnp.add, acc, (l, g)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(body, zero, micro)
        loss, grads = loss / A, jax.tree.map(lambda g: g / A, grads)
    updates, opt_state = optimizer(cfg).update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "lr": schedule(cfg)(state["step"])}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def compile_step(cfg: TrainConfig, state_shardings, batch_sharding):
    """``train_step`` under one jit: the state donated and kept on its shardings."""
    return jax.jit(train_step, static_argnames=("cfg",), donate_argnames=("state",),
                   in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, None))


def flops_per_token(cfg: TrainConfig) -> float:
    """Training FLOPs per token: 6 x (non-embedding parameters) + attention's 6·L·T·D
    (forward 2·L·T·D for QKᵀ and PV each, backward twice that; Kaplan et al. / PaLM's MFU)."""
    m = cfg.model
    per_layer = (m.hidden_size * m.head_dim * (m.num_heads * 2 + m.num_kv_heads * 2)
                 + m.hidden_size * m.intermediate_size * (3 if m.mlp == "swiglu" else 2))
    head = m.hidden_size * m.vocab_size
    return 6.0 * (m.num_layers * per_layer + head) + 6.0 * m.num_layers * cfg.seq_len * \
        m.num_heads * m.head_dim


# bf16 dense peak per device (vendor figures): MFU's fallback where no rate is measured.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0, "TPU v6 lite": 918.0,
               "TPU v6e": 918.0}


def measured_tflops(n: int = 8192, reps: int = 10) -> float:
    """The device's bfloat16 matmul rate, measured: ``reps`` chained [n, n] products, timed after
    a warm-up (what a training step's matmuls can reach on this card, clocks and all)."""
    import time
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)

    @jax.jit
    def chain(x, w):  # w an argument: a closed-over array would be a constant in the program
        for _ in range(reps):
            x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16) * 0.01
        return x
    chain(a, a).block_until_ready()
    t0 = time.perf_counter()
    chain(a, a).block_until_ready()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def peak_tflops(cfg: TrainConfig) -> tuple[float | None, str]:
    """Per-device bfloat16 rate for MFU and where it comes from: ``cfg.peak_tflops`` ("set"),
    else on an accelerator the measured matmul rate ("measured"; the vendor's peak when the
    measurement fails), else None (CPUs: pass --set peak_tflops=X to get an MFU)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops, "set"
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None, "none"
    try:
        return measured_tflops(), "measured bf16 matmul"
    except Exception:  # e.g. out of memory next to another process: the datasheet instead
        for name, tf in PEAK_TFLOPS.items():
            if name.lower() in dev.device_kind.lower():
                return tf, "vendor peak"
    return None, "none"
