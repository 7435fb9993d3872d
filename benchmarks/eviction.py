"""Score-based eviction (H2O, Q-Hitter) against window and StreamingLLM: perplexity per KV budget,
Q-Hitter's λ ablation, and the decode-step cost of the score bookkeeping.

1. perplexity of the embedded models over held-out text (the corpus' second half), one token
   per step, per budget: a share of each --seq-token segment (the models were trained on 256
   tokens, so a full cache longer than that is out of their range; the segments are streamed
   one by one and their scores pooled), and 4+124 = 128 slots over one --tokens stream (every
   policy rolls its positions, so a long stream is in range), for window, StreamingLLM
   (4 sinks), H2O (half heavy, half recent: the paper's 10% + 10% at 20%), H2O+quant and
   Q-Hitter (the authors' 15% / 5% split with 7/15 of the heavy slots by attention alone, λ 0.5)
   at 4 and 3 bits per token over the whole head, against the full (dense) cache;
2. the λ ablation at 3 bits and a 20% budget (Q-Hitter Fig. 9);
3. decode ms/token of a full cache (random Pythia-160M weights) for StreamingLLM, H2O and
   Q-Hitter at the same number of slots, measured in one process.

Tables 1-2 go to docs/RESULTS.md, table 3 to docs/BENCHMARKS.md.

    python benchmarks/eviction.py                    # CPU-sized defaults
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402
from _record import record, time_decode  # noqa: E402

import jax  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.corpus import builtin_corpus  # noqa: E402
from jaxllm.kv.quantized import KVQuant  # noqa: E402
from jaxllm.model import apply  # noqa: E402
from jaxllm.policy import H2O, Dense, KVStorage, QHitter, StreamingLLM, Window  # noqa: E402
from jaxllm.ppl import stream_nll  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "RESULTS.md")


def q(bits):
    """Per-token codes over the whole head (the Q-Hitter authors' quantizer)."""
    return KVStorage(quant=KVQuant("token", bits=bits, group=0))


def policies(budget: int) -> dict:
    """Every method at ``budget`` slots."""
    h, r = budget // 2, budget - budget // 2
    qh, qr = budget - budget // 4, budget // 4
    return {"window": Window(budget),
            "StreamingLLM": StreamingLLM(4, budget),
            "H2O": H2O(0, budget, h, r),
            "H2O+quant 4-bit": H2O(0, budget, h, r, q(4)),
            "H2O+quant 3-bit": H2O(0, budget, h, r, q(3)),
            "Q-Hitter 4-bit": QHitter(0, budget, qh, qr, storage=q(4)),
            "Q-Hitter 3-bit": QHitter(0, budget, qh, qr, storage=q(3))}


def ppl(params, cfg, segments, pc) -> float:
    """Perplexity pooled over the segments, each streamed through its own cache, one token per
    forward call."""
    nll = np.concatenate([stream_nll(params, cfg, s, pc, chunk=1) for s in segments])
    return float(np.exp(nll.astype(np.float64).mean()))


def budget_table(a, models) -> tuple[str, str]:
    shares = [float(x) for x in a.budgets.split(",")]
    cols = [f"{s:.0%}" for s in shares] + ["4+124"]
    head = "| model | method | " + " | ".join(cols) + " |"
    lines = [head, "|---|---|" + "---:|" * len(cols)]
    lam_lines = ["| model | " + " | ".join(f"λ {x:g}" for x in a.lams) + " |",
                 "|---|" + "---:|" * len(a.lams)]
    for model, (cfg, params, ids) in models.items():
        segs = [ids[i * a.seq:(i + 1) * a.seq] for i in range(a.segments)]
        full = ppl(params, cfg, segs, Dense())
        lines.append(f"| {model} | full cache | " + " | ".join(
            [f"{full:.3f}"] * len(shares)) + " | (out of range) |")
        table = {}
        for b, texts in [(max(4, int(s * a.seq)), segs) for s in shares] + [(128, [ids])]:
            for name, pc in policies(b).items():
                table.setdefault(name, []).append(ppl(params, cfg, texts, pc))
                print(f"{model} {pc.label} over {len(texts)} x {len(texts[0])}: "
                      f"{table[name][-1]:.3f}", flush=True)
        for name, vals in table.items():
            lines.append(f"| {model} | {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
        b = int(0.2 * a.seq)
        row = []
        for lam in a.lams:
            pc = QHitter(0, b, b - b // 4, b // 4, lam=lam, storage=q(3))
            row.append(ppl(params, cfg, segs, pc))
        lam_lines.append(f"| {model} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    return "\n".join(lines), "\n".join(lam_lines)


def timing_table(a) -> str:
    """Decode ms/token per policy, each against StreamingLLM with the same KV storage. The
    policies' steps are timed in interleaved rounds (``--rounds`` of ``--steps`` each) and the
    median round is reported, so a slow spell of a shared machine hits every policy alike."""
    from jaxllm.policy import QHITTER_KV
    cfg = jaxllm.PRESETS[a.timing_preset]
    params = jaxllm.init_params(cfg, jax.random.key(0))
    step = jax.jit(functools.partial(apply, cfg=cfg), donate_argnames=("cache",))
    lines = ["| slots | batch | policy | ms/token (median) | min–max | vs StreamingLLM, same "
             "storage |", "|---:|---:|---|---:|---:|---:|"]
    for L in [int(x) for x in a.timing_caches.split(",")]:
        for B in [int(x) for x in a.timing_batch.split(",")]:
            pols = [StreamingLLM(4, L), H2O(4, L),
                    QHitter(4, L, storage=KVStorage()),  # float storage: the bookkeeping alone
                    StreamingLLM(4, L, KVStorage(quant=QHITTER_KV)),
                    QHitter(4, L)]  # 4-bit storage, the authors' setting
            caches = []
            for pc in pols:
                cache = pc.make_cache(cfg, B, L)
                # fill it first, so every timed step evicts
                _, cache = step(params, tokens=np.ones((B, L), np.int32), cache=cache,
                                lens=np.full((B,), L, np.int32))
                caches.append(cache)
            times = [[] for _ in pols]
            for _ in range(a.rounds):
                for i in range(len(pols)):
                    ms, caches[i] = time_decode(step, params, caches[i], a.steps, warmup=1)
                    times[i].append(ms)
            del caches
            base = {}
            for pc, t in zip(pols, times):
                ms = float(np.median(t))
                q = pc.storage.quant
                storage = q.describe() if q.enabled else "float"
                base.setdefault(storage, ms)  # StreamingLLM comes first for each storage
                lines.append(f"| {L} | {B} | {pc.label} | {ms:.1f} | "
                             f"{min(t):.1f}–{max(t):.1f} | {ms / base[storage]:.2f}x |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,embedded-sink")
    ap.add_argument("--tokens", type=int, default=2048,
                    help="held-out tokens streamed for the 4+124 column")
    ap.add_argument("--seq", type=int, default=256,
                    help="segment length for the budget shares (the models' trained context)")
    ap.add_argument("--segments", type=int, default=8, help="segments pooled per budget share")
    ap.add_argument("--budgets", default="0.05,0.1,0.2,0.5", help="shares of a segment")
    ap.add_argument("--lams", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--timing-preset", default="pythia-160m")
    ap.add_argument("--timing-caches", default="1024,4096")
    ap.add_argument("--timing-batch", default="1")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--skip", default="", help="comma-separated: ppl, timing")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    skip = set(a.skip.split(",")) - {""}
    if "ppl" not in skip:
        models = {}
        for m in a.models.split(","):
            cfg, params, tok = jaxllm.load_model(m)
            ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
            models[m] = (cfg, params, ids[len(ids) // 2:][:max(a.tokens, a.seq * a.segments)])
        budgets, lams = budget_table(a, models)
        doc, _record.DOC = _record.DOC, RESULTS  # quality tables belong with the results
        try:
            record("H2O and Q-Hitter: perplexity per KV budget", f"Budget shares of "
                   f"{a.segments} held-out segments of {a.seq} tokens (pooled); 4+124: one stream "
                   f"of {a.tokens} tokens through 128 slots; one token per step:\n\n" + budgets +
                   f"\n\nQ-Hitter λ ablation, 3-bit, 20% of {a.seq}:\n\n" + lams,
                   dry=a.no_record)
        finally:
            _record.DOC = doc
    if "timing" not in skip:
        record("Score-based eviction: decode step cost", f"Decode step, {a.timing_preset} "
               f"(random weights), a full cache:\n\n" + timing_table(a), dry=a.no_record)


if __name__ == "__main__":
    main()
