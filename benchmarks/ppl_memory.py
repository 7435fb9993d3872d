"""Constant memory: peak RSS of `jaxllm ppl` at growing stream lengths (StreamingLLM cache).

Each length runs in a fresh process so peak RSS is that run's own. Target (core issue): peak RSS
at 100K tokens within 10% of that at 10K tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _record import record  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:pythia-14m")
    ap.add_argument("--method", default="streaming")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--tokens", default="10000,100000")
    ap.add_argument("--no-record", action="store_true", help="print only")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.tokens.split(",")]:
            out = os.path.join(tmp, f"{n}.json")
            cmd = [sys.executable, "-m", "jaxllm.cli", "ppl", "--model", a.model, "--corpus",
                   "builtin", "--method", a.method, "--sinks", str(a.sinks), "--cache",
                   str(a.cache), "--max-tokens", str(n), "--json", out, "--quiet"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                rows.append(json.load(f))
    base = rows[0]["peak_rss_mb"]
    lines = ["| tokens | method | cache | ppl | tokens/s | peak RSS (MiB) | vs first |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens_scored'] + 1} | {r['method']} | {r['label']} | "
                     f"{r['ppl']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / base:.3f}x |")
    table = "\n".join(lines)
    worst = max(r["peak_rss_mb"] for r in rows) / base
    verdict = (f"Peak RSS ratio {worst:.3f} (target <= 1.10): "
               f"{'met' if worst <= 1.10 else 'NOT met'}. Model {a.model}.")
    record("Constant memory: `jaxllm ppl` peak RSS vs stream length", table, verdict,
           dry=a.no_record)


if __name__ == "__main__":
    main()
