"""How much sooner a second run of the same command starts, with the CLI's persistent XLA
compilation cache and the converted-model cache (convert.converted): `jaxllm ppl` run twice in
fresh processes against one new cache directory (and once with both caches off), timing the
whole command and the seconds its run spent compiling (the JSON's compile_seconds, from
jax.monitoring's events), and reading the time to its first scored chunk from the progress
line."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _record import machine, record  # noqa: E402


def run(cache_dir: str, extra: list, out: str, model: str, tokens: int, **env: str) -> dict:
    env = dict(os.environ, JAXLLM_CACHE_DIR=cache_dir, **env)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "jaxllm.cli", *extra, "ppl", "--model", model, "--max-tokens",
           str(tokens), "--quiet", "--json", out]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    r = json.load(open(out))
    # Until the first token is scored: all but the scoring itself.
    return {"wall_s": wall, "compile_s": r["compile_seconds"],
            "first_token_s": wall - r["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dry", action="store_true", help="print, do not record")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cache, out = os.path.join(d, "cache"), os.path.join(d, "r.json")
        rows = {"no cache": run(os.path.join(d, "none"), ["--no-compile-cache"], out, a.model,
                                a.tokens, JAXLLM_MODEL_CACHE="0"),
                "first run, empty cache": run(cache, [], out, a.model, a.tokens),
                "second run": run(cache, [], out, a.model, a.tokens)}
    lines = ["| run | whole command (s) | until scoring starts (s) | compiling (s) |",
             "|---|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['first_token_s']:.1f} | "
                     f"{r['compile_s']:.1f} |")
    first, second = rows["first run, empty cache"], rows["second run"]
    notes = (f"`python benchmarks/compile_cache.py --model {a.model} --tokens {a.tokens}` on "
             f"{machine()}: the second run starts scoring "
             f"{first['first_token_s'] / second['first_token_s']:.1f}x sooner than the first.")
    table = "\n".join(lines)
    print(table + "\n\n" + notes)
    record("Compilation cache: a second run of the same command", table, notes, dry=a.dry)


if __name__ == "__main__":
    main()
