"""The PoSE experiment (Zhu et al. 2024, Table 1 and Fig. 3) at CPU size.

One base model is trained at a short context Lc, then extended to Lt = factor x Lc in four ways
under the same number of fine-tuning steps and the same batch:

* (a) no fine-tuning: the base as is, and position interpolation only (linear, NTK, YaRN);
* (b) full-length fine-tuning at Lt (with linear interpolation, the seed's baseline);
* (c) PoSE at Lc with linear, NTK and YaRN scaling;
* (d) PoSE (YaRN) with a learnable sink token.

Reported: perplexity on held-out text at lengths Lc .. Lt (the seed's Table 1 layout), passkey
accuracy by length (the seed's prompt format, ``jaxllm.evals.passkey``), and the cost the
seed's Fig. 3 shows: seconds per step and the compiled step's peak memory, PoSE at Lc against
full length at Lt, measured in the same run.

    python -m train.experiments.pose --out runs/pose            # CPU: about 10 minutes

Runs go to OUT/<name>; finished runs are not retrained. Results: OUT/results.json and
OUT/table.md.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np


def configs(a) -> dict:
    """The base recipe and every fine-tuning run's TrainConfig."""
    from jaxllm.config import RopeScaling

    from train.config import recipe
    Lc, Lt = a.lc, a.lc * a.factor
    common = [f"batch_size={a.batch}", "log_every=10", f"seed={a.seed}"] + list(a.set)
    base = recipe("tiny", common + [f"seq_len={Lc}", f"model.max_seq_len={Lc}",
                                    f"steps={a.base_steps}", f"ckpt_every={a.base_steps}"])
    s = float(a.factor)
    scale = {"linear": RopeScaling("linear", s), "ntk": RopeScaling("ntk", s),
             "yarn": RopeScaling("yarn", s, original_max_len=Lc)}

    def ft(rope, **kw):
        model = dataclasses.replace(base.model, max_seq_len=Lt, rope_scaling=scale[rope])
        return dataclasses.replace(base, model=model, steps=a.ft_steps, ckpt_every=a.ft_steps,
                                   warmup_frac=0.0, lr=a.ft_lr, **kw)

    runs = {"full-length linear": ft("linear", seq_len=Lt)}
    for rope in scale:
        runs[f"PoSE {rope}"] = ft(rope, pose_target=Lt)
    runs["PoSE yarn + learnable sink"] = ft("yarn", pose_target=Lt, sink="learnable")
    return base, scale, runs


def perplexity(params, cfg, text: np.ndarray, L: int, windows: int) -> float:
    """Mean NLL of every token of ``windows`` non-overlapping L-token windows of ``text``,
    each read with a plain causal forward (a learnable-sink model gets its sink first)."""
    from jaxllm.policy import Dense
    from jaxllm.ppl import stream_nll
    nll = [stream_nll(params, cfg, text[i * L:(i + 1) * L], Dense())
           for i in range(windows)]
    return float(np.exp(np.concatenate(nll).astype(np.float64).mean()))


def step_cost(cfg, run: str) -> dict:
    """Seconds per optimiser step (from the run's log) and the compiled step's peak temporary
    memory (XLA's memory analysis of the loss and gradient for one batch)."""
    import jax
    import jax.numpy as jnp

    from train.plot import read_metrics
    from train.step import init_state, loss_fn
    metrics = read_metrics(run)
    tps = np.median([m["tokens_per_s"] for m in metrics[1:]] or [metrics[0]["tokens_per_s"]])
    params = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))["params"]
    L = cfg.seq_len + 1
    batch = jax.ShapeDtypeStruct((cfg.batch_size, L), jnp.int32)
    if cfg.pose_target:
        batch = (batch, batch)
    grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)
    mem = grad.lower(params, cfg, batch).compile().memory_analysis()
    return {"seconds_per_step": float(cfg.tokens_per_step / tps),
            "peak_temp_mib": float(mem.temp_size_in_bytes / 2**20)}


def evaluate(models: dict, text: np.ndarray, a) -> dict:
    from jaxllm.evals.passkey import passkey_grid
    from jaxllm.policy import Dense
    from jaxllm.tokenizer import ByteTokenizer
    Lc, Lt = a.lc, a.lc * a.factor
    lengths = sorted({Lc, 2 * Lc, 4 * Lc, Lt})
    enc = ByteTokenizer().encode
    out = {}
    for name, (cfg, params) in models.items():
        ppl = {L: perplexity(params, cfg, text, L, max(1, a.eval_tokens // L)) for L in lengths}
        grid = passkey_grid(params, cfg, enc, Dense(), lengths,
                            [0.0, 0.5, 1.0], a.trials, a.seed)
        out[name] = {"ppl": ppl, "passkey": dict(zip(lengths, grid.mean(1).tolist()))}
        print(f"{name}: " + " ".join(f"{L}: {p:.3f}" for L, p in ppl.items()), flush=True)
    return out


def table(res: dict, a, cost: dict) -> str:
    Lc, Lt = a.lc, a.lc * a.factor
    lengths = sorted({Lc, 2 * Lc, 4 * Lc, Lt})
    head = "| model | " + " | ".join(f"ppl @{L}" for L in lengths) + " | " + \
        " | ".join(f"passkey @{L}" for L in lengths) + " |"
    lines = [head, "|---|" + "---:|" * (2 * len(lengths))]
    for name, r in res.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['ppl'][L]:.3f}" for L in lengths) + " | "
                     + " | ".join(f"{r['passkey'][L]:.2f}" for L in lengths) + " |")
    lines += ["", "| run | context trained | seconds / step | peak step memory (MiB) |",
              "|---|---:|---:|---:|"]
    for name, c in cost.items():
        lines.append(f"| {name} | {c['context']} | {c['seconds_per_step']:.3f} | "
                     f"{c['peak_temp_mib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from jaxllm.argtypes import COUNT, real
    from jaxllm.cli.common import CliError, Parser, seed_int
    ap = Parser(prog="python -m train.experiments.pose", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="experiment directory")
    ap.add_argument("--lc", type=COUNT, default=64, help="training context Lc (tokens)")
    ap.add_argument("--factor", type=COUNT, default=8, help="Lt = factor x Lc")
    ap.add_argument("--base-steps", type=COUNT, default=600, help="base model steps at Lc")
    ap.add_argument("--ft-steps", type=COUNT, default=150, help="steps of every extension run")
    ap.add_argument("--ft-lr", type=real(0.0, 1.0, lo_open=True), default=1e-3,
                    help="fine-tuning learning rate")
    ap.add_argument("--batch", type=COUNT, default=16, help="sequences per step, every run")
    ap.add_argument("--eval-tokens", type=COUNT, default=2048,
                    help="held-out tokens per length for perplexity (the base run holds out "
                         "about 7,600 of the builtin corpus)")
    ap.add_argument("--trials", type=COUNT, default=2, help="passkeys per length and depth")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of every run and the passkeys")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe field of every run (repeatable)")
    try:
        a = ap.parse_args(argv)
    except CliError as e:
        print(e, file=sys.stderr)
        return 2
    from jaxllm.io import load_model

    from train.loop import heldout_text, train
    base, scale, runs = configs(a)
    base_run = os.path.join(a.out, "base")
    train(base, base_run, progress=True)
    base_model = os.path.join(base_run, "model")
    cfg0, params0, _ = load_model(base_model)
    models = {"base (no extension)": (cfg0, params0)}
    for rope, sc in scale.items():  # (a) interpolation only
        models[f"{rope} interpolation, no training"] = (
            dataclasses.replace(cfg0, rope_scaling=sc, max_seq_len=a.lc * a.factor), params0)
    cost = {}
    for name, cfg in runs.items():
        run = os.path.join(a.out, name.replace(" ", "_").replace("+", "plus"))
        cfg = dataclasses.replace(cfg, init_from=os.path.abspath(base_model))
        train(cfg, run, progress=True)
        c, p, _ = load_model(os.path.join(run, "model"))
        models[name] = (c, p)
        if name in ("full-length linear", "PoSE linear"):
            cost[name] = dict(step_cost(cfg, run), context=cfg.seq_len)
    text = heldout_text(base_run, a.eval_tokens)
    res = evaluate(models, text, a)
    md = table(res, a, cost)
    print(md)
    from jaxllm.outputs import write_json, write_text
    write_json(os.path.join(a.out, "results.json"), {"args": vars(a), "results": res,
                                                     "cost": cost})
    write_text(os.path.join(a.out, "table.md"), md + "\n")
    print(f"wrote {a.out}/results.json and {a.out}/table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
