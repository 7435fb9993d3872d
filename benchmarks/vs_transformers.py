"""jaxllm against transformers (PyTorch, CPU) on the same random-weight Pythia-160M: prefill
tokens/s (512-token prompts) and decode tokens/s (16-token prompt, 64 greedy tokens, a dense
cache on both sides) at batch 1 and 8, side by side in one process. Needs torch.

--dtype: float32 on both sides; bfloat16: transformers in bfloat16 throughout, jaxllm with
bfloat16 weights (quant.half_weights: its fast CPU form, products and a float32 KV cache);
w8: jaxllm's weight-only int8 against transformers in float32 (issue 16's W8 target)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _record import read_ceiling_ms, record  # noqa: E402


def _best(fns, n):
    """The best of ``n`` timings of each function, their runs alternating (this host is shared:
    a disturbance then hits both sides' neighbouring runs, not one side's whole series)."""
    for fn in fns:
        fn()  # warm-up / compile
    times = [[] for _ in fns]
    for _ in range(n):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "w8"), default="float32",
                    help="the weights of both sides (see above)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import torch
    import transformers as tf

    import convert
    import jaxllm
    from jaxllm.model import apply
    c = jaxllm.PRESETS["pythia-160m"]
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.GPTNeoXConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size, rotary_pct=0.25,
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None)).eval()
    cfg, params = convert.from_hf(hf)
    if a.dtype == "bfloat16":  # both sides' weights in bfloat16 (torch computes in it too)
        hf = hf.to(torch.bfloat16)
        params = jaxllm.quant.half_weights(params)
    elif a.dtype == "w8":  # smoothing does not change the speed
        ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 4096)
        params = jaxllm.smoothquant.quantize(params, cfg, ids, "w8", smooth=False,
                                             calib=jaxllm.CalibConfig(n_seqs=2, seq_len=64,
                                                                      batch=2))
    target, vs = {"float32": (1.5, "transformers"), "bfloat16": (1.0, "transformers"),
                  "w8": (2.5, "transformers' float32")}[a.dtype]
    rng = np.random.default_rng(0)
    fwd = jax.jit(lambda p, t: apply(p, cfg, t)[0])
    lines = ["| measure | batch | transformers (torch) | jaxllm | jaxllm / transformers |",
             "|---|---:|---:|---:|---:|"]
    ratios, speed = {}, {}
    for B in (1, 8):
        x = rng.integers(0, cfg.vocab_size, (B, a.prefill))
        xt, xj = torch.as_tensor(x), jnp.asarray(x, jnp.int32)
        with torch.no_grad():
            t_hf, t_j = _best([lambda: hf(xt, use_cache=False).logits,
                               lambda: fwd(params, xj).block_until_ready()], a.repeats)
        n = B * a.prefill
        lines.append(f"| prefill tokens/s | {B} | {n / t_hf:.0f} | {n / t_j:.0f} | "
                     f"{t_hf / t_j:.2f}x |")
        p = rng.integers(0, cfg.vocab_size, (B, 16))
        pt, pj = torch.as_tensor(p), jnp.asarray(p, jnp.int32)
        N = a.new_tokens
        sc = jaxllm.SamplingConfig(max_new_tokens=N)
        with torch.no_grad():
            t_hf, t_j = _best([
                lambda: hf.generate(pt, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                    pad_token_id=0),
                lambda: jaxllm.generate(params, cfg, pj, jaxllm.init_cache(
                    cfg, B, sinks=0, window=16 + N, ring=False),
                    sc).tokens.block_until_ready()],
                a.repeats)
        ratios[B] = t_hf / t_j
        speed[B] = (B * N / t_hf, B * N / t_j)
        lines.append(f"| decode tokens/s (16 + {N}) | {B} | {B * N / t_hf:.1f} | "
                     f"{B * N / t_j:.1f} | {t_hf / t_j:.2f}x |")
    # The batch-1 ceiling: a decode step reads every weight once, so no implementation on this
    # machine decodes faster than one pass over the weights' bytes (the roofline's read ceiling:
    # the faster of a sum and a matrix-vector product over a float32 buffer of that size).
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    t_read = read_ceiling_ms(n_bytes) / 1e3
    ceiling = 1.0 / t_read
    lines.append(f"| weight-read ceiling tokens/s (1 pass over {n_bytes / 2**20:.0f} MiB) | 1 | "
                 f"{ceiling:.1f} | {ceiling:.1f} | |")
    notes = (f"Weights: {a.dtype}. Ceiling: one read of jaxllm's {n_bytes / 1e6:.0f} MB of "
             f"weights takes "
             f"{t_read * 1e3:.1f} ms ({n_bytes / t_read / 1e9:.1f} GB/s), so batch-1 decode "
             f"cannot exceed {ceiling:.1f} tokens/s here; transformers reaches "
             f"{speed[1][0] / ceiling:.0%} of it and jaxllm {speed[1][1] / ceiling:.0%}, and "
             f"{target}x transformers ({target * speed[1][0]:.1f} tokens/s) is "
             f"{'above' if target * speed[1][0] > ceiling else 'within'} the ceiling. "
             f"transformers {tf.__version__}, torch {torch.__version__} "
             f"({torch.get_num_threads()} threads); best of {a.repeats}, the two sides' runs "
             f"alternating. Decode time includes the 16-token prefill on both sides. Target: "
             f"jaxllm decode >= {target}x {vs}: "
             + ", ".join(f"batch {B} {r:.2f}x ({'met' if r >= target else 'NOT met'})"
                         for B, r in ratios.items()) + ".")
    table = "\n".join(lines)
    record(f"jaxllm vs transformers (PyTorch CPU), Pythia-160M, random weights, {a.dtype}",
           table, notes,
           dry=a.no_record)


if __name__ == "__main__":
    main()
