"""Decode on an accelerator at a real model's shapes: ms per step and cache bytes for each KV
storage format and weight format, and transformers' bfloat16 generate on the same device in the
same run.

Random weights of a preset (default Llama-2-7B shapes), a StreamingLLM ``sinks + window`` cache
filled by a prompt of ``sinks + window`` tokens (so every step attends over a full ring), then
``--steps`` greedy tokens per row by ``jaxllm.generate`` (one jit around the decode loop, the
cache donated). Per row of the table: prefill ms (one compiled call), decode ms per step, the
cache's bytes, and the largest batch whose cache would fit beside the weights and the step's
temporaries (from the device's memory limit and XLA's compile-time accounting of the step; an
estimate, marked as such). ``--transformers`` adds transformers' LlamaForCausalLM in bfloat16 on
the same device: its default generate, and a static cache with ``torch.compile``.

``--attention pallas,blockwise`` runs the KV rows by each attention form in one process: the
kernel that reads the cache as stored (pallas_kernels.decode) and the XLA form that decodes it
first (the config's ``kernels.attention``: each form is its own program).

Every record also goes to ``<out>/decode.json``: a list of {engine, device, weights, kv,
attention, batch, cache, prompt, decode_ms, prefill_ms, kv_bytes, max_batch_estimate}, written
after each row, so a run cut short keeps what it measured.

    python benchmarks/gpu_decode.py --out docs/gpu/2026-11-26-h100 --transformers
    python benchmarks/gpu_decode.py --preset llama-tiny --window 60 --batch 1 --steps 4  # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _profile import profiled  # noqa: E402
from _record import record, time_generate  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import gptq, smoothquant as sq  # noqa: E402
from jaxllm.attention import flash  # noqa: E402
from jaxllm.config import Kernels  # noqa: E402
from jaxllm.kv.cache import kv_bytes  # noqa: E402
from jaxllm.kv.quantized import KVQuant  # noqa: E402
from jaxllm.model import apply  # noqa: E402

KV_FORMATS = {"bf16": KVQuant(), "int8": KVQuant("int8"), "token-4": KVQuant("token", 4, 32),
              "token-2": KVQuant("token", 2, 32), "kivi-4": KVQuant("kivi", 4, 32, residual=32),
              "kivi-2": KVQuant("kivi", 2, 32, residual=32)}
WEIGHT_FORMATS = ("bf16", "w8a8", "w8", "w4")  # w4: 4-bit groups of 128 (RTN), Pallas kernel


def fit(spec: KVQuant, head_dim: int) -> KVQuant:
    """Groups of 32 channels, or the largest divisor of head_dim below that."""
    if not spec.enabled or spec.format == "int8":
        return spec
    g = math.gcd(spec.group, head_dim)
    return dataclasses.replace(spec, group=g, residual=max(spec.residual // g, 1) * g)


def weights(name: str, cfg, params):
    """(cfg, params) of a weight format; compute in bfloat16."""
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    if name in ("bf16", "w4"):
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    if name == "bf16":
        return cfg, params
    if name == "w4":  # GPTQ's layout (embedding, head, norms bf16); RTN needs no calibration
        return cfg, gptq.quantize_model(params, cfg, np.zeros((1, 8), np.int32),
                                        gptq.GPTQConfig("rtn", 4, 128))[0]
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 4096)
    q = sq.quantize(params, cfg, ids, {"w8": "w8", "w8a8": "o1"}[name], smooth=False,
                    calib=sq.CalibConfig(n_seqs=2, seq_len=64, batch=2))
    return cfg, q


def device_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def step_temp_bytes(cfg, params, cache) -> int:
    """Temporaries of one decode step, from XLA's compile-time accounting (abstract arrays)."""
    abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)  # noqa: E731
    B = cache.batch
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    return step.lower(abstract(params), tokens=jax.ShapeDtypeStruct((B, 1), jnp.int32),
                      cache=abstract(cache), lens=jax.ShapeDtypeStruct((B,), jnp.int32)
                      ).compile().memory_analysis().temp_size_in_bytes


def jaxllm_row(cfg, params, kv: KVQuant, B: int, sinks: int, window: int, steps: int,
               profile: str = "", title: str = "") -> dict:
    """Prefill a full ring, then decode ``steps`` tokens per row; ``profile``: a markdown file
    to which one more decode call, traced, adds its top ops under ``title`` (_profile)."""
    kv = fit(kv, cfg.head_dim)
    cache = jaxllm.init_cache(cfg, B, sinks=sinks, window=window, dtype=jnp.bfloat16,
                              kv_quant=kv if kv.enabled else None)
    P = sinks + window
    prompt = jax.random.randint(jax.random.key(1), (B, P), 0, cfg.vocab_size)
    lens = jnp.full((B,), P, jnp.int32)
    temp = step_temp_bytes(cfg, params, cache)
    prefill = jax.jit(functools.partial(apply, cfg=cfg, last_only=True),
                      donate_argnames=("cache",)).lower(
        params, tokens=prompt, cache=cache, lens=lens).compile()
    t0 = time.perf_counter()
    logits, cache = prefill(params, tokens=prompt, cache=cache, lens=lens)
    jax.block_until_ready((logits, cache))
    prefill_ms = (time.perf_counter() - t0) * 1e3
    decode_ms, cache = time_generate(params, cfg, cache, steps)
    if profile:
        with profiled(profile, title, per=steps + 1):
            cache = jaxllm.generate(params, cfg, prompt[:, :1], cache,
                                    jaxllm.SamplingConfig(max_new_tokens=steps)).cache
            jax.block_until_ready(cache)
    nbytes = kv_bytes(cache)
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    limit = device_limit()
    fits = None if limit is None else int((limit - weight_bytes - temp) // (nbytes / B))
    return dict(engine="jaxllm", kv=kv.describe() if kv.enabled else "bfloat16", batch=B,
                prompt=P, decode_ms=round(decode_ms, 3), prefill_ms=round(prefill_ms, 1),
                kv_bytes=nbytes, max_batch_estimate=fits)


def transformers_rows(cfg, B: int, P: int, steps: int) -> list[dict]:
    """transformers' LlamaForCausalLM (random weights, the same shapes) in bfloat16 on the same
    device: default generate, and a static cache with torch.compile. Prefill ms is a generate
    stopped after its first token; decode ms per step is (generate of ``steps`` tokens - that)
    / (steps - 1). No end token (random weights could produce it and stop early); the token
    count of the timed call is checked."""
    import torch
    import transformers as tf
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                            intermediate_size=cfg.intermediate_size,
                            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                            num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.norm_eps,
                            max_position_embeddings=max(P + steps, 4096),
                            rope_theta=cfg.rope_theta)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(hf_cfg).to(device=dev, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, cfg.vocab_size, (B, P), device=dev)
    rows = []

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    class AfterOne(tf.StoppingCriteria):  # the prompt and one token: the prefill's time
        def __call__(self, input_ids, scores, **kw):
            return input_ids.shape[1] >= P + 1

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    for label, kw in (("transformers default", {}),
                      ("transformers static+compile", {"cache_implementation": "static"})):
        if kw:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        # The same max_new_tokens for both calls (a static cache's size, so no recompile).
        gen = functools.partial(model.generate, ids, do_sample=False, max_new_tokens=steps,
                                pad_token_id=0, **kw)
        one = functools.partial(gen, stopping_criteria=tf.StoppingCriteriaList([AfterOne()]))
        with torch.inference_mode():
            gen(), one()  # warm-up (and compilation)
            prefill, total = timed(one), timed(gen)
            assert gen().shape[1] == P + steps, "transformers stopped before --steps tokens"
        rows.append(dict(engine=label, kv="bfloat16 (dense)", batch=B, prompt=P,
                         decode_ms=round((total - prefill) / (steps - 1) * 1e3, 3),
                         prefill_ms=round(prefill * 1e3, 1), kv_bytes=None,
                         max_batch_estimate=None))
    del model
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=4092)
    ap.add_argument("--kv", default="bf16,int8,token-4,kivi-2", help="of " + ", ".join(KV_FORMATS))
    ap.add_argument("--weights", default="bf16,w8a8,w8,w4",
                    help="of " + ", ".join(WEIGHT_FORMATS) + "; these run with a bf16 cache")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--attention", default="auto",
                    help="attention forms for the KV rows, comma-separated: auto, pallas, "
                         "blockwise (jaxllm.attention.flash.BACKENDS)")
    ap.add_argument("--transformers", action="store_true")
    ap.add_argument("--out", default="", help="folder for decode.json (default: none written)")
    ap.add_argument("--profile", default="", help="markdown file: each row's top ops, from one "
                    "more decode call traced by jax.profiler (default: none)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    cfg0 = jaxllm.PRESETS[a.preset]
    if a.layers:
        cfg0 = dataclasses.replace(cfg0, num_layers=a.layers)
    for name in a.kv.split(","):
        if name not in KV_FORMATS:
            raise SystemExit(f"unknown --kv {name!r}; choose from {', '.join(KV_FORMATS)}")
    for name in a.weights.split(","):
        if name not in WEIGHT_FORMATS:
            raise SystemExit(f"unknown --weights {name!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    dev = jax.devices()[0]
    device = dev.device_kind if dev.platform != "cpu" else "cpu"
    cache_label = f"StreamingLLM {a.sinks}+{a.window}"
    records, path = [], os.path.join(a.out, "decode.json") if a.out else None
    params0 = jaxllm.init_params(cfg0, jax.random.key(0))

    def keep(rec: dict) -> None:
        rec = dict(rec, device=device, cache=cache_label)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if path:
            os.makedirs(a.out, exist_ok=True)
            with open(path, "w") as f:
                json.dump(records, f, indent=1)

    forms = a.attention.split(",")
    for form in forms:
        if form not in flash.BACKENDS:
            raise SystemExit(f"unknown --attention {form!r}; choose from "
                             f"{', '.join(flash.BACKENDS)}")
    for wname in a.weights.split(","):
        cfg, params = weights(wname, cfg0, params0)
        for form in forms if wname == "bf16" else forms[:1]:
            cfg = dataclasses.replace(cfg, kernels=Kernels(attention=form))
            for kname in a.kv.split(",") if wname == "bf16" else ["bf16"]:
                for B in (int(b) for b in a.batch.split(",")):
                    try:
                        row = jaxllm_row(cfg, params, KV_FORMATS[kname], B, a.sinks, a.window,
                                         a.steps, a.profile, f"{wname} weights, KV {kname}, "
                                         f"{form} attention, batch {B}, {cache_label}")
                    except ValueError as e:  # a format that refuses this cache
                        row = dict(engine="jaxllm", kv=kname, batch=B,
                                   prompt=a.sinks + a.window, decode_ms=None, prefill_ms=None,
                                   kv_bytes=None, max_batch_estimate=None, refused=str(e))
                    keep(dict(row, weights=wname,
                              attention=flash.backend(cfg.kernels.attention)))
        del params
    if a.transformers:
        for B in (int(b) for b in a.batch.split(",")):
            for rec in transformers_rows(cfg0, B, a.sinks + a.window, a.steps):
                keep(dict(rec, weights="bf16", attention="-"))
    # "vs bf16 cache": against the bfloat16 cache's row at the same batch and attention form.
    base = {(r["batch"], r["attention"]): r["decode_ms"] for r in records
            if r["engine"] == "jaxllm" and r["weights"] == "bf16" and r["kv"] == "bfloat16"}
    lines = ["| engine | weights | KV | attention | batch | prefill ms | decode ms/step | "
             "vs bf16 cache | KV MiB | max batch (est.) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        head = f"| {r['engine']} | {r['weights']} | {r['kv']} | {r['attention']} | {r['batch']} |"
        if r["decode_ms"] is None:
            lines.append(f"{head} refused: {r['refused']} | | | | |")
            continue
        b = base.get((r["batch"], r["attention"]))
        rel = f"{r['decode_ms'] / b:.2f}x" if b else "-"
        mib = "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 2 ** 20:.1f}"
        fits = "-" if r["max_batch_estimate"] is None else str(r["max_batch_estimate"])
        lines.append(f"{head} {r['prefill_ms']} | {r['decode_ms']} | {rel} | {mib} | {fits} |")
    record(f"Decode at {a.preset} shapes ({cfg0.num_layers} layers, random weights), "
           f"{cache_label} filled by the prompt, {device}", "\n".join(lines), dry=a.no_record)


if __name__ == "__main__":
    main()
