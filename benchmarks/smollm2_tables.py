"""The papers' tables on SmolLM2-135M-Instruct (the packaged real model), at settings that fit a
2-core CPU; each table is printed as markdown with its command, settings and wall time, and
appended to bench_out/smollm2_tables.md (docs/RESULTS.md quotes them).

    python benchmarks/smollm2_tables.py table1      # StreamingLLM Table 1's shape, caches 256, 1024
    python benchmarks/smollm2_tables.py kv          # every KV storage format at StreamingLLM 4+256
    python benchmarks/smollm2_tables.py smoothquant # naive W8A8 vs SmoothQuant O1/O2/O3 vs W8
    python benchmarks/smollm2_tables.py eviction    # H2O vs Q-Hitter at 4-bit KV, one budget
    python benchmarks/smollm2_tables.py long        # 16K tokens: dense vs StreamingLLM 4+1020

The text is the embedded corpus (Python's documentation): its first tokens are scored, its
second half calibrates SmoothQuant. Recompute is scored at positions sampled past the first
window (jaxllm.ppl.recompute_at), beside StreamingLLM's losses at the same positions.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

import jaxllm
from jaxllm.corpus import builtin_corpus
from jaxllm.kv.cache import kv_bytes
from jaxllm.kv.quantized import KVQuant
from jaxllm.policy import H2O, Dense, KVStorage, QHitter, Recompute, StreamingLLM, Window
from jaxllm.ppl import recompute_at, stream_score

OUT = os.path.join(os.path.dirname(__file__), "..", "bench_out", "smollm2_tables.md")


def ppl(nll) -> float:
    return float(np.exp(np.asarray(nll, np.float64).mean()))


def sampled(n_tokens: int, lo: int, k: int, seed: int = 0) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(np.arange(lo, n_tokens - 1), k,
                                                      replace=False))


def table1(params, cfg, ids, a) -> list[str]:
    """Dense, window and StreamingLLM with 1/2/4/8 sinks at each cache size; recompute at sampled
    positions beside StreamingLLM 4+W at the same positions."""
    rows = ["| cache | method | ppl | recompute at the same positions | StreamingLLM there |",
            "|---:|---|---:|---:|---:|"]
    dense = ppl(stream_score(params, cfg, ids, Dense())[0])
    rows.append(f"| - | dense ({len(ids)} tokens) | {dense:.2f} | | |")
    for C in a.caches:
        rows.append(f"| {C} | window 0+{C} | "
                    f"{ppl(stream_score(params, cfg, ids, Window(C))[0]):.2f} | | |")
        for S in (1, 2, 4, 8):
            nll = stream_score(params, cfg, ids, StreamingLLM(S, C))[0]
            extra = "| | |"
            if S == 4:
                pos = sampled(len(ids), C, a.positions)
                rec = recompute_at(params, cfg, ids, Recompute(S, C), pos)
                extra = f"| {ppl(rec):.2f} ({len(pos)} positions) | {ppl(nll[pos]):.2f} |"
            rows.append(f"| {C} | StreamingLLM {S}+{C - S} | {ppl(nll):.2f} {extra}")
    return rows


def kv(params, cfg, ids, a) -> list[str]:
    S, C = 4, 4 + 256
    formats = [("float32", KVQuant()), ("int8 per token", KVQuant("int8")),
               ("4-bit per token, group 16", KVQuant("token", 4, 16)),
               ("4-bit per token, head", KVQuant("token", 4, 0)),
               ("2-bit per token, group 16", KVQuant("token", 2, 16)),
               ("KIVI-4, G 32, R 128", KVQuant("kivi", 4, 32, residual=128)),
               ("KIVI-2, G 32, R 128", KVQuant("kivi", 2, 32, residual=128))]
    rows = ["| KV storage (StreamingLLM 4+256, sinks in float) | ppl | KV bytes / token |",
            "|---|---:|---:|"]
    for name, q in formats:
        pc = StreamingLLM(S, C, KVStorage(quant=q))
        per_tok = kv_bytes(pc.make_cache(cfg, 1, C)) / C
        rows.append(f"| {name} | {ppl(stream_score(params, cfg, ids, pc)[0]):.2f} | "
                    f"{per_tok:,.0f} |")
    return rows


def smoothquant(params, cfg, ids, a, calib_ids) -> list[str]:
    from jaxllm.smoothquant import CalibConfig, quantize
    calib = CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len, heldout_seqs=8)
    pc = StreamingLLM(4, 256)
    rows = ["| weights / activations | alpha | ppl (StreamingLLM 4+252) |", "|---|---:|---:|",
            f"| float32 | - | {ppl(stream_score(params, cfg, ids, pc)[0]):.2f} |"]
    runs = [("W8 weight-only", "w8", None, False), ("naive W8A8 O1", "o1", None, False),
            ("naive W8A8 O2", "o2", None, False), ("naive W8A8 O3", "o3", None, False),
            ("SmoothQuant O1", "o1", 0.85, True), ("SmoothQuant O1", "o1", 0.5, True),
            ("SmoothQuant O1", "o1", "auto", True), ("SmoothQuant O2", "o2", "auto", True),
            ("SmoothQuant O3", "o3", "auto", True)]
    for name, scheme, alpha, smooth in runs:
        q, info = quantize(params, cfg, calib_ids, scheme, alpha, smooth=smooth, calib=calib,
                           return_info=True)
        shown = f"{info['alpha']:.2f}" + (" (auto)" if alpha == "auto" else "") if smooth else "-"
        rows.append(f"| {name} | {shown} | {ppl(stream_score(q, cfg, ids, pc)[0]):.2f} |")
    return rows


def eviction(params, cfg, ids, a) -> list[str]:
    q4 = KVStorage(quant=KVQuant("token", 4, 0))
    S, heavy, recent = 4, 126, 126  # 256 slots, as StreamingLLM 4+252
    rows = ["| policy (256 slots, 4-bit per-token KV) | ppl |", "|---|---:|"]
    for name, pc in [("StreamingLLM 4+252", StreamingLLM(4, 256, q4)),
                     ("H2O 4+126+126", H2O(S, 256, heavy, recent, q4)),
                     ("Q-Hitter 4+126+126, lambda 0.5", QHitter(S, 256, heavy, recent, q4,
                                                                lam=0.5))]:
        rows.append(f"| {name} | {ppl(stream_score(params, cfg, ids, pc)[0]):.2f} |")
    return rows


def long(params, cfg, ids, a) -> list[str]:
    rows = [f"| method ({len(ids)} tokens) | ppl | last 1,024 tokens |", "|---|---:|---:|"]
    for name, pc in [("dense", Dense()),
                     ("StreamingLLM 4+1020", StreamingLLM(4, 1024))]:
        nll = stream_score(params, cfg, ids, pc)[0]
        rows.append(f"| {name} | {ppl(nll):.2f} | {ppl(nll[-1024:]):.2f} |")
    return rows


TABLES = {"table1": table1, "kv": kv, "smoothquant": smoothquant, "eviction": eviction,
          "long": long}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table", choices=sorted(TABLES))
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens scored (default: 4096; kv, smoothquant, eviction 2048; long 16384)")
    ap.add_argument("--caches", default="256,1024")
    ap.add_argument("--positions", type=int, default=64, help="recompute's sampled positions")
    ap.add_argument("--n-seqs", type=int, default=64, help="SmoothQuant calibration sequences")
    ap.add_argument("--seq-len", type=int, default=512)
    a = ap.parse_args()
    a.caches = [int(c) for c in a.caches.split(",")]
    n = a.tokens or {"table1": 4096, "long": 16384}.get(a.table, 2048)
    t0 = time.time()
    cfg, params, tok = jaxllm.load_model("smollm2")
    ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
    calib_ids = ids[len(ids) // 2:]
    ids = ids[:n]
    fn = TABLES[a.table]
    rows = fn(params, cfg, ids, a, calib_ids) if a.table == "smoothquant" else \
        fn(params, cfg, ids, a)
    secs = time.time() - t0
    head = [f"### {a.table} (SmolLM2-135M-Instruct, {len(ids)} tokens of the embedded corpus)",
            "", f"`python benchmarks/smollm2_tables.py {' '.join(sys.argv[1:])}` on "
            f"{platform.node()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}, "
            f"{secs / 60:.1f} min wall.", ""]
    text = "\n".join(head + rows) + "\n"
    print(text)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
