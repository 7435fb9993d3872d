"""SmoothQuant W8A8 on this CPU: accuracy per scheme and alpha, weight memory, decode and prefill
speed against float32. Prints the tables and appends them to docs/BENCHMARKS.md.

Accuracy needs a trained model and activation outliers. Until the training issue ships one, this
script trains a small byte-level model on the embedded corpus itself (cached in bench_out/, the
command is in the output) and reports whether it has outlier channels; if it has none, it gives
the model LLM-like outliers without changing its function (a few norm gains x60, the rows of the
linears reading them /60; SmoothQuant Fig. 4), so the float perplexity is unchanged.
Speed and memory use the Pythia-160M architecture with random weights (values do not matter).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from _record import record  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import smoothquant as sq  # noqa: E402
from jaxllm.corpus import builtin_corpus  # noqa: E402
from jaxllm.model import apply  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "bench_out")


def train_small(ids: np.ndarray, steps: int, seq: int = 256, batch: int = 16):
    """A plain AdamW loop (the train package is a later issue); returns cfg, params, losses."""
    cfg = jaxllm.ModelConfig.gpt_neox(vocab_size=jaxllm.ByteTokenizer.vocab_size, hidden_size=192,
                                      num_layers=4, num_heads=6, max_seq_len=seq)
    params = jaxllm.init_params(cfg, jax.random.key(0))
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0, 2e-3, steps // 20, steps,
                                                                     2e-4), 0.9, 0.95,
                                  weight_decay=0.1))
    state = opt.init(params)

    def loss_fn(p, x):
        logits, _ = apply(p, cfg, x[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, x[:, 1:, None], -1).mean()

    @jax.jit
    def step(p, s, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        up, s = opt.update(g, s, p)
        return optax.apply_updates(p, up), s, loss

    rng = np.random.default_rng(0)
    losses = []
    for i in range(steps):
        starts = rng.integers(0, len(ids) - seq - 1, batch)
        x = jnp.asarray(np.stack([ids[s:s + seq + 1] for s in starts]))
        params, state, loss = step(params, state, x)
        if i % 100 == 0 or i == steps - 1:
            losses.append(float(loss))
            print(f"  step {i}: loss {float(loss):.3f}", flush=True)
    return cfg, params


def outlier_ratio(stats: dict) -> float:
    """max over layers of (largest channel max / median channel max) of the norm outputs."""
    return max(float(v.max() / np.median(v)) for k, v in stats.items() if k.endswith("attn/q"))


def accuracy(a) -> tuple[str, str]:
    tok = jaxllm.ByteTokenizer()
    ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
    split = int(len(ids) * 0.9)
    train_ids, test_ids = ids[:split], ids[split:]
    path = os.path.join(OUT, f"sq_model_{a.train_steps}")
    if os.path.exists(path):
        cfg, params, _ = jaxllm.load_model(path)
    else:
        print(f"training a small model for {a.train_steps} steps (cached in {path})")
        t = time.time()
        cfg, params = train_small(train_ids, a.train_steps)
        print(f"  {time.time() - t:.0f} s")
        jaxllm.save_model(path, cfg, params, overwrite=True)
    cc = sq.CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len, heldout_seqs=8)
    calib_ids = train_ids[-200_000:]  # calibration text: training-domain, not the test split
    stats = sq.calibrate(params, cfg, sq.calibration_windows(calib_ids, cc, False)[0])
    natural = outlier_ratio(stats)
    injected = natural < 20
    if injected:
        params = sq.add_outlier_channels(params, cfg, (3, 17, 60, 101), 100.0)
    test = test_ids[: (len(test_ids) // a.seq_len) * a.seq_len].reshape(-1, a.seq_len)[:a.eval_seqs]
    ppl = lambda p: float(np.exp(sq.heldout_loss(p, cfg, test)))
    base = ppl(params)
    rows = [("float32", "-", "-", base)]
    for scheme in ("o1", "o2", "o3"):
        rows.append((f"naive W8A8 ({scheme})", scheme, "-",
                     ppl(sq.quantize(params, cfg, calib_ids, scheme, smooth=False, calib=cc))))
    for scheme in ("o1", "o2", "o3"):
        for alpha in (0.5, 0.8, "auto"):
            q, info = sq.quantize(params, cfg, calib_ids, scheme, alpha, calib=cc,
                                  return_info=True)
            rows.append((f"SmoothQuant {scheme}", scheme, f"{info['alpha']:.2f}"
                         + (" (auto)" if alpha == "auto" else ""), ppl(q)))
    rows.append(("weight-only int8", "w8", "0.50",
                 ppl(sq.quantize(params, cfg, calib_ids, "w8", 0.5, calib=cc))))
    lines = ["| model | scheme | alpha | ppl | vs float |", "|---|---|---:|---:|---:|"]
    for name, scheme, alpha, p in rows:
        lines.append(f"| {name} | {scheme} | {alpha} | {p:.3f} | {100 * (p / base - 1):+.1f}% |")
    naive = {sc: p for n, sc, _, p in rows if n.startswith("naive")}
    best = {s: min(p for n, sc, _, p in rows if n.startswith("SmoothQuant") and sc == s)
            for s in ("o1", "o3")}
    notes = (f"Model: {cfg.num_layers}-layer, {cfg.hidden_size}-wide byte-level GPT-NeoX trained "
             f"{a.train_steps} steps on 90% of the embedded corpus; ppl over "
             f"{test.size} held-out bytes (the last 10%). Largest/median channel max of the "
             f"attention input: {natural:.1f}x"
             + (" — no natural outliers, so 4 channels were given x100 norm gains (function "
                "unchanged; float ppl is the trained model's)." if injected else ".")
             + f" Targets: naive W8A8 (the paper's baseline, per-tensor dynamic = o2 without "
             f"smoothing) > +20%: {100 * (naive['o2'] / base - 1):+.1f}% "
             f"({'met' if naive['o2'] / base > 1.2 else 'NOT met'}); O1 within 2%: "
             f"{100 * (best['o1'] / base - 1):+.1f}% ({'met' if best['o1'] / base <= 1.02 else 'NOT met'})"
             f"; O3 within 5%: {100 * (best['o3'] / base - 1):+.1f}% "
             f"({'met' if best['o3'] / base <= 1.05 else 'NOT met'})."
             + (" Caveat: injected outliers are a per-channel scaling, exactly what smoothing "
                "undoes, so the smoothed rows are an upper bound on recovery; natural outliers "
                "of a larger trained model are the harder test." if injected else ""))
    return "\n".join(lines), notes


def _time(fn, n):
    fn()  # compile
    t = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def speed(a) -> tuple[str, str]:
    cfg = jaxllm.PRESETS["pythia-160m"]
    params = jaxllm.init_params(cfg, jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 20_000)
    q = sq.quantize(params, cfg, ids, "o1", calib=sq.CalibConfig(n_seqs=4, seq_len=128))
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
    ratio = nbytes(q) / nbytes(params)
    lines = ["| measure | batch | float32 | W8A8 o1 (int8) | speed-up |", "|---|---:|---:|---:|---:|"]
    lines.append(f"| weights in memory (MiB) | - | {nbytes(params) / 2**20:.0f} | "
                 f"{nbytes(q) / 2**20:.0f} | {ratio:.3f}x |")
    sc = jaxllm.SamplingConfig(max_new_tokens=a.decode_tokens)
    for window in (252, 28):
        for B in (1, 8):
            prompt = jnp.asarray(ids[: B * 16].reshape(B, 16))
            res = {}
            for name, p in (("f32", params), ("int8", q)):
                def run(p=p):
                    cache = jaxllm.init_cache(cfg, B, sinks=4, window=window)
                    return jaxllm.generate(p, cfg, prompt, cache, sc).tokens
                res[name] = B * a.decode_tokens / _time(run, 3)
            lines.append(f"| decode tokens/s (StreamingLLM 4+{window}) | {B} | {res['f32']:.1f} |"
                         f" {res['int8']:.1f} | {res['int8'] / res['f32']:.2f}x |")
    fwd = jax.jit(lambda p, t: apply(p, cfg, t)[0])
    for B in (1, 8):
        toks = jnp.asarray(ids[: B * 512].reshape(B, 512))
        res = {n: B * 512 / _time(lambda p=p: fwd(p, toks), 3) for n, p in (("f32", params),
                                                                            ("int8", q))}
        lines.append(f"| prefill tokens/s (512 tokens) | {B} | {res['f32']:.0f} | "
                     f"{res['int8']:.0f} | {res['int8'] / res['f32']:.2f}x |")
    notes = (f"Pythia-160M architecture, random weights; int8 = o1 (per-tensor weights, per-token "
             f"dynamic activations), embedding table int8 per row. Weights ratio {ratio:.3f} "
             f"(target <= 0.27: {'met' if ratio <= 0.27 else 'NOT met'}); target speed-up >= 1.5x. "
             f"A decode step also reads the float32 KV cache several times (keys are re-rotated "
             f"each step, docs/METHODS.md §1); at batch 8 with 256 slots that traffic, not the "
             f"matmuls, dominates on this CPU (~5 GB/s DRAM), so the 4+28 rows show the "
             f"matmul-bound regime. The cache path is the evaluation issue's to speed up.")
    return "\n".join(lines), notes


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--train-steps", type=int, default=500)
    ap.add_argument("--n-seqs", type=int, default=64, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences scored")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--skip", choices=["accuracy", "speed"], default=None)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    for part, fn in (("accuracy", accuracy), ("speed", speed)):
        if a.skip == part:
            continue
        table, notes = fn(a)
        title = {"accuracy": "SmoothQuant W8A8: perplexity by scheme and alpha (CPU)",
                 "speed": "SmoothQuant W8A8: weight memory, decode and prefill speed (CPU)"}[part]
        record(title, table, notes, dry=a.no_record)


if __name__ == "__main__":
    main()
