"""What the calibration text does to GPTQ: SmolLM2 at 4 bits in groups of 128, GPTQ calibrated
on Python's documentation alone (the old default) and on the embedded mixed text (the default
now: jaxllm.corpus.calibration_corpus), against plain rounding (RTN) and the float model;
perplexity (dense, the first N tokens) on text none of them calibrated on: the shipped novel's
held-out chapters X-XII (prose), and the tail of the embedded corpus (English about code).

    python benchmarks/calibration.py [--tokens 2048] [--n-seqs 32] [--seq-len 512] [--dry]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _record import machine, record  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import gptq  # noqa: E402
from jaxllm.corpus import builtin_corpus, calibration_corpus, prose  # noqa: E402
from jaxllm.policy import Dense  # noqa: E402
from jaxllm.ppl import run_ppl  # noqa: E402
from jaxllm.smoothquant import CalibConfig, calibration_windows  # noqa: E402

DOCS_HELD_OUT = 600_000  # the embedded corpus from this character on calibrates nothing here


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens scored per text")
    ap.add_argument("--n-seqs", type=int, default=32, help="calibration windows (quantize's)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dry", action="store_true", help="print, do not record")
    a = ap.parse_args()
    cfg, params, tok = jaxllm.load_model("smollm2")
    docs = builtin_corpus()
    evals = {"prose (novel, ch. X-XII)": prose(held_out=True), "code docs (corpus tail)":
             docs[DOCS_HELD_OUT:]}
    evals = {k: np.asarray(tok.encode(v)[:a.tokens]) for k, v in evals.items()}
    texts = {"GPTQ, Python docs": docs[:DOCS_HELD_OUT], "GPTQ, mixed (default)":
             calibration_corpus()}
    models = {"float32": params,
              "RTN": gptq.quantize_model(params, cfg, np.zeros((0, a.seq_len), np.int32),
                                         gptq.GPTQConfig("rtn"))[0]}
    seconds = {}
    for name, text in texts.items():
        calib, _ = calibration_windows(np.asarray(tok.encode(text)),
                                       CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len), False)
        t0 = time.perf_counter()
        models[name] = gptq.quantize_model(params, cfg, calib, gptq.GPTQConfig("gptq"))[0]
        seconds[name] = time.perf_counter() - t0
    lines = ["| weights (4-bit g128 unless float) | " + " | ".join(evals) + " |",
             "|---|" + "---:|" * len(evals)]
    for name, p in models.items():
        cells = [run_ppl(p, cfg, ids, Dense(), progress=False)[1]["ppl"] for ids in evals.values()]
        lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    table = "\n".join(lines)
    notes = (f"`python benchmarks/calibration.py --tokens {a.tokens} --n-seqs {a.n_seqs} "
             f"--seq-len {a.seq_len}` on {machine()}: perplexity of the first {a.tokens} tokens, "
             f"dense; GPTQ calibrated on {a.n_seqs} x {a.seq_len} tokens ("
             + ", ".join(f"{k}: {v:.0f} s" for k, v in seconds.items()) + ").")
    print(table + "\n\n" + notes)
    record("Calibration text: GPTQ on prose and code it did not calibrate on", table, notes,
           dry=a.dry)


if __name__ == "__main__":
    main()
