"""Decode and prefill against this machine's limits, measured in one process.

Decode is bound by the bytes a step must read: every weight once (the embedding table aside,
which a step reads B rows of, unless it is also the tied head) and every K and V slot of the
fixed-shape cache (StreamingLLM reads all slots each step, full or not). For each weight format
(float32; float32 kept [out, in]; bfloat16 weights; bfloat16 weights and KV cache; float16
weights and KV cache; W8: int8 weights only; W8A8 O1: int8 weights and per-token int8
activations; all compute in float32 on CPU), each cache and batch, the table shows the step
time (a step's share of a ``jaxllm.generate`` call, its one-jit decode loop, the way users
decode; the same step called from Python once per token is shown beside it), those bytes, the
read ceiling and the fraction of it the step reaches. The read ceiling is those bytes at the
fastest read rate measured in this process: each row's bytes are read by two kernels (a float32
sum and an Eigen matrix-vector product, best of 20 each), and a row's bar is the fastest rate
that a read of as many bytes or more reached in the run, so a busy moment of a shared machine
during one row's reads does not lower that row's bar.

That bar is a best moment, and this shared machine's read rate moves between about 26 and
47 GB/s from minute to minute. So each round also reads 512 MiB right after the format's steps
(best of 3) and prices the row's bytes at that rate: "of read now" is the median over the rounds
of that read's time over the step's, the step against the memory as it was at that moment.

Then why a step falls short: the step's weight products alone (every linear layer's product for
B rows, in the format's own form, chained in one jit, no attention) and the fraction of the
weights' read ceiling they reach: what XLA:CPU's product code does with exactly those bytes,
which a step cannot beat; and the step's passes over the cache alone (each layer's keys' and
values' writes and its scores-softmax-values pass, in jaxllm's forms for the cache's dtype:
benchmarks/kv_products.py). The step's time is about the two plus norms, softmax and the rest;
benchmarks/step_profile.py measures that rest (XLA's small ops) and the rate at which the
step's own large ops read, from a profile of the same generate call.

Prefill (a plain forward of --prefill tokens, batch 1) is bound by the matrix units: the GEMM
ceiling is the time of the model's own linear layers as bare dot products of the same shapes and
dtype (int8 x int8 -> int32 for W8A8) in one jit; attention, norms and the rest are the gap.

    python benchmarks/roofline.py                      # Pythia-160M shapes, random weights
    python benchmarks/roofline.py --preset pythia-14m --caches 252 --batch 1 --no-record
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import (best_ms, full_ring, read_ceiling_ms, record, steady_heap,  # noqa: E402
                     time_decode, time_generate)
from kv_products import step_passes_ms  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import smoothquant as sq  # noqa: E402
from jaxllm.model import apply  # noqa: E402
from jaxllm.policy import StreamingLLM  # noqa: E402
from jaxllm.quant import QKernel, decode_weights, qmatmul  # noqa: E402

FORMATS = ("float32", "f32oi", "bf16", "bf16kv", "f16kv", "w8", "w8a8")
NOW_BYTES = 512 << 20  # the read that prices each round's bytes at that moment's rate
LABELS = {"float32": "float32", "f32oi": "float32 [out, in]", "bf16": "bfloat16 weights",
          "bf16kv": "bfloat16 weights + KV", "f16kv": "float16 weights + KV",
          "w8": "W8 (int8 weights)", "w8a8": "W8A8 O1"}


def variant(name: str, cfg, params):
    """(cfg, params, KV cache dtype) of one weight format; every format computes in float32."""
    if name == "float32":
        return cfg, params, jnp.float32
    if name == "f32oi":  # the same weights kept [out, in] (quant.decode_weights)
        return cfg, decode_weights(params, "float32"), jnp.float32
    if name in ("bf16", "bf16kv"):  # 2-byte weights, stored [out, in] (quant.decode_weights)
        return (cfg, decode_weights(params, "bfloat16"),
                jnp.bfloat16 if name == "bf16kv" else jnp.float32)
    if name == "f16kv":
        return cfg, decode_weights(params, "float16"), jnp.float16
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 4096)
    scheme = {"w8": "w8", "w8a8": "o1"}[name]  # smoothing does not change the speed
    q = sq.quantize(params, cfg, ids, scheme, smooth=False,
                    calib=sq.CalibConfig(n_seqs=2, seq_len=64, batch=2))
    return cfg, q, jnp.float32


def weight_bytes(cfg, params) -> int:
    """What one decode step reads of the weights: all of them but an untied embedding table."""
    tree = dict(params)
    if not cfg.tie_embeddings:
        tree.pop("embed")
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def linear_kernels(params) -> list:
    """Every linear layer's kernel, in the params' order: a float [in, out] array, or a
    ``QKernel`` ([out, in]: int8, or a float weight kept for decoding)."""
    kernels = []

    def visit(node):
        if isinstance(node, dict):
            if "kernel" in node:
                kernels.append(node["kernel"])
            for child in node.values():
                visit(child)
    visit(params)
    return kernels


def linear_shapes(params) -> list[tuple[int, int]]:
    """(in, out) of every linear layer."""
    return [tuple(k.q.shape[::-1]) if isinstance(k, QKernel) else tuple(k.shape)
            for k in linear_kernels(params)]


def products_ms(cfg, params, B: int) -> float:
    """The step's weight products alone, for ``B`` rows, in the format's own form (the model's
    dispatch: ``qmatmul`` for a quantized or [out, in] node, a plain product for a float kernel),
    one after the other in one jit (best of 10): what XLA:CPU's product code reaches over
    exactly the weight bytes a step reads, without attention, norms or the cache."""
    kernels = linear_kernels(params)
    n_in = [k.q.shape[1] if isinstance(k, QKernel) else k.shape[0] for k in kernels]
    if cfg.tie_embeddings:  # the table [vocab, dim] is the head: [out, in], as the model reads it
        kernels.append(params["embed"]["embedding"])
        n_in.append(cfg.hidden_size)
    xs = [jax.random.normal(jax.random.key(i), (B, n)) for i, n in enumerate(n_in)]
    head = len(kernels) - 1 if cfg.tie_embeddings else None

    def chain(kernels, xs):
        y = None
        for i, (k, x) in enumerate(zip(kernels, xs)):
            if y is not None:  # each product waits for the one before, as in the model
                x = x + 1e-30 * y[:, :1]
            y = (qmatmul(x, k) if isinstance(k, QKernel) else
                 jnp.einsum("bd,vd->bv", x, k) if i == head else x @ k)
        return y
    return best_ms(jax.jit(chain), kernels, xs, n=10)


def gemm_ceiling_ms(shapes, T: int, name: str) -> float:
    """The model's linear layers as bare dot products of ``T`` rows, in the format's dtype."""
    if name == "w8a8":
        xs = [jnp.ones((T, i), jnp.int8) for i, _ in shapes]
        ws = [jnp.ones((o, i), jnp.int8) for i, o in shapes]
        dot = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),  # noqa: E731
                                               preferred_element_type=jnp.int32)
    else:
        dt = {"bf16": jnp.bfloat16, "bf16kv": jnp.bfloat16, "f16kv": jnp.float16}.get(
            name, jnp.float32)
        xs = [jnp.ones((T, i), dt) for i, _ in shapes]
        ws = [jnp.ones((i, o), dt) for i, o in shapes]
        dot = jnp.dot
    fn = jax.jit(lambda xs, ws: [dot(x, w) for x, w in zip(xs, ws)])
    return best_ms(fn, xs, ws, n=5)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="pythia-160m")
    ap.add_argument("--formats", default=",".join(FORMATS), help="of " + ", ".join(FORMATS))
    ap.add_argument("--caches", default="252,4092", help="window sizes (4 sinks each)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (the median is shown)")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (batch 1)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    formats = [f for f in a.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            ap.error(f"unknown format {f!r}; choose from {', '.join(FORMATS)}")
    cfg0 = jaxllm.PRESETS[a.preset]
    params0 = jaxllm.init_params(cfg0, jax.random.key(0))
    dec = ["| format | cache | batch | ms/step in generate | ms/step called alone | "
           "speed vs float32 | weights + KV read (MiB) | "
           "read ceiling (ms) | of ceiling | read now (ms) | of read now | weight products alone "
           "(ms) | products: of weight ceiling | KV passes alone (ms) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    # (label, cache, batch, ms a step in generate, ms a step called alone, speed, weight bytes,
    #  KV bytes, read now ms, of read now, products ms, KV ms)
    rows = []
    probe = jnp.ones((NOW_BYTES // 4096, 1024), jnp.float32)
    probe_sum = jax.jit(jnp.sum)
    rates = []  # (bytes, bytes per ms) of every read measured in this run
    prods = {}  # (format, batch) -> the weight products alone, ms
    kv_ms = {}  # (KV dtype, batch, slots) -> the step's cache passes alone, ms
    pre = ["| format | tokens | prefill ms | GEMM ceiling ms | of ceiling | GEMM GFLOP/s |",
           "|---|---:|---:|---:|---:|---:|"]
    models = {name: variant(name, cfg0, params0) for name in formats}
    steps = {name: jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
             for name, (cfg, _, _) in models.items()}
    for W in [int(x) for x in a.caches.split(",")]:
        pc = StreamingLLM(4, 4 + W)
        for B in [int(x) for x in a.batch.split(",")]:
            # Every format's rounds alternate, so a machine slowing down mid-run (a shared one
            # does) shifts all of them alike and the ratios between formats hold.
            caches = {n: full_ring(pc.make_cache(m[0], B, 0, dtype=m[2]))
                      for n, m in models.items()}
            kvb = {n: sum(x.nbytes for x in jax.tree.leaves((c.k, c.v)))
                   for n, c in caches.items()}
            times = {n: [] for n in models}  # ms a step in generate's loop
            calls = {n: [] for n in models}  # ms a step called from Python
            nbytes = {n: weight_bytes(m[0], m[1]) + kvb[n] for n, m in models.items()}
            now = {n: [] for n in models}  # (read ms at this moment's rate, its share of the step)
            for r in range(a.rounds + 1):  # round 0 compiles and warms up
                for n, (cfg, params, _) in models.items():
                    ms, caches[n] = time_generate(params, cfg, caches[n], a.steps)
                    called, caches[n] = time_decode(steps[n], params, caches[n], a.steps,
                                                    warmup=1)
                    if r:
                        times[n].append(ms)
                        calls[n].append(called)
                        read = nbytes[n] / (probe.nbytes / best_ms(probe_sum, probe, n=3))
                        now[n].append((read, read / ms))
            del caches
            for n, (cfg, params, _) in models.items():
                wb = weight_bytes(cfg, params)
                ms = float(np.median(times[n]))
                rates.append((wb + kvb[n], (wb + kvb[n]) / read_ceiling_ms(wb + kvb[n])))
                if (n, B) not in prods:
                    prods[n, B] = products_ms(cfg, params, B)
                    rates.append((wb, wb / read_ceiling_ms(wb)))
                kvk = (jnp.dtype(models[n][2]).name, B, 4 + W)
                if kvk not in kv_ms:
                    G = cfg.num_heads // cfg.num_kv_heads
                    R = 3 if cfg.pos_emb == "rope" and cfg.rotary_dim > 0 else 1
                    kv_ms[kvk] = cfg.num_layers * step_passes_ms(
                        B * cfg.num_kv_heads, 4 + W, kvk[0], R * G, G, cfg.head_dim)
                vs = (f"{np.median(times['float32']) / ms:.2f}x" if "float32" in times
                      else "-")
                rows.append((LABELS[n], pc.label, B, ms, float(np.median(calls[n])), vs, wb,
                             kvb[n], float(np.median([t for t, _ in now[n]])),
                             float(np.median([f for _, f in now[n]])), prods[n, B], kv_ms[kvk]))
                print(f"{LABELS[n]}, {pc.label}, batch {B}: {ms:.1f} ms a step in generate "
                      f"({np.median(calls[n]):.1f} a step called alone), weight products "
                      f"alone {prods[n, B]:.1f} ms", flush=True)

    def ceiling_ms(nbytes: int) -> float:
        # ``nbytes`` at the fastest rate a read of as many bytes or more reached in this run. A
        # busy moment of this shared machine can slow all 20 reads of one row. Memory does not
        # deliver bytes faster for a larger read (a smaller one may come from the caches), so a
        # rate the memory reached for a larger read is one this row's bytes can be read at.
        # The read kernels do not reach it at every size (W8's 119 MB of weights read in 4.3 ms,
        # 28 GB/s, against 47 GB/s over 2.4 GB in run 10), which makes this the stricter bar.
        return nbytes / max(r for m, r in rates if m >= nbytes)
    del probe
    for label, cache, B, ms, called, vs, wb, kv, now_ms, now_f, pm, km in rows:
        ceil, wceil = ceiling_ms(wb + kv), ceiling_ms(wb)
        dec.append(f"| {label} | {cache} | {B} | {ms:.1f} | {called:.1f} | {vs} | "
                   f"{wb / 2**20:.0f} + "
                   f"{kv / 2**20:.0f} | {ceil:.1f} | {ceil / ms:.0%} | {now_ms:.1f} | "
                   f"{now_f:.0%} | {pm:.1f} | {wceil / pm:.0%} | {km:.1f} |")
    T = a.prefill
    for name, (cfg, params, _) in models.items():
        toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, T)))
        fwd = jax.jit(lambda p, t, cfg=cfg: apply(p, cfg, t)[0])
        ms = best_ms(fwd, params, toks, n=3)
        shapes = linear_shapes(params)
        gemm = gemm_ceiling_ms(shapes, T, name)
        flops = 2 * T * sum(i * o for i, o in shapes)
        pre.append(f"| {LABELS[name]} | {T} | {ms:.0f} | {gemm:.0f} | {gemm / ms:.0%} | "
                   f"{flops / gemm / 1e6:.1f} |")
        print(pre[-1], flush=True)
    table = (f"Decode step ({a.preset} shapes, random weights, StreamingLLM cache with a full "
             f"ring; ms/step in generate: one call of jaxllm.generate writing {a.steps} tokens "
             f"per row (one jit around the decode loop, the cache donated) over its "
             f"{a.steps + 1} one-token forwards, median of {a.rounds} "
             f"rounds, the formats' rounds interleaved; ms/step called alone: the same step "
             f"called from Python once per token, as runs before 23 timed it; speed, of ceiling "
             f"and of read now use generate's time; speed: "
             f"float32's time over the format's; read ceiling: the bytes at the fastest rate "
             f"that a read of as many bytes or more reached in the run (each row's bytes read "
             f"best of 20); read now: the row's bytes at the rate of a 512 MiB read right after "
             f"each round's steps (best of 3), median over rounds; of read now: the median over "
             f"rounds of that read's time over the round's step time; weight products alone: "
             f"every linear layer's product for the "
             f"batch's rows in the format's form, chained, best of 10; KV passes alone: every "
             f"layer's cache writes and its scores-softmax-values pass in jaxllm's forms for the "
             f"cache's dtype, benchmarks/kv_products.py, best of 10 each):\n\n"
             + "\n".join(dec) +
             f"\n\nPrefill ({T} tokens, batch 1, best of 3):\n\n" + "\n".join(pre))
    record(f"Roofline: decode and prefill against this machine's limits ({a.preset})", table,
           dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
