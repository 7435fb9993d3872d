"""Two builds of jaxllm's CPU kernels in one process, SmolLM2's decode alternated between them:
the working tree's kernels against a git revision's (``--base``).

Why: this project's CPU figures come from a shared 2-core VM whose speed swings by 30% and more
within minutes, so separate processes cannot resolve a kernel change worth 5-20% (docs/CPU.md).
Here the base build is compiled from ``git show REV:pallas_kernels/csrc/...`` with the same
flags, registered with XLA under the kernels' target names + "_base", and two jitted copies of
generate's loop are traced, one calling each set of targets (so neither recompiles when the
calls alternate: a b, b a, a b, ...). Each call decodes --new tokens after a --prompt-token
prompt in a StreamingLLM 4+1020 cache; both builds must produce the same tokens.

    python benchmarks/kernel_ab.py --base HEAD --formats 4bit,4bit-a8 --reps 12
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from _record import record  # noqa: E402

FORMATS = ("4bit", "4bit-a8", "float32", "bfloat16")
# (the module's name of a target, the library's handler symbol)
HANDLERS = (("TARGET", "JaxllmInt8Rows"), ("TOKEN_TARGET", "JaxllmInt8RowsToken"),
            ("ATTENTION_TARGET", "JaxllmDecodeAttention"), ("LOWBIT_TARGET", "JaxllmLowbitRows"),
            ("FLOAT_TARGET", "JaxllmFloatRows"))


def build_base(rev: str, out: Path) -> Path:
    """The kernels' library built from revision ``rev``'s sources (same compiler and flags as
    pallas_kernels.cpu.build); a source that revision does not have is left out (its kernel's
    calls then go to the working tree's build in both programs)."""
    import jax

    from pallas_kernels import cpu
    sources = []
    for f in cpu.SOURCES + cpu.HEADERS:
        rel = f.relative_to(ROOT).as_posix()
        got = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{rel}"], capture_output=True,
                             text=True)
        if got.returncode != 0:
            if f in cpu.HEADERS:
                raise SystemExit(f"kernel_ab: {rev} has no {rel}")
            continue
        (out / f.name).write_text(got.stdout)
        if f in cpu.SOURCES:
            sources.append(out / f.name)
    lib = out / "base.so"
    cxx = os.environ.get("CXX") or "c++"
    subprocess.run([cxx, *cpu.FLAGS, "-isystem", jax.ffi.include_dir(), *map(str, sources),
                    "-o", str(lib)], check=True)
    return lib


def traced_apart(f):
    """``f`` as a function object of its own. JAX caches a trace by the function traced, so two
    jit objects of one function share the first one's trace: the second build's program would
    call the first build's kernels (an A/A run, as every run of this script was until
    2026-11-29)."""
    return functools.wraps(f)(lambda *args, **kw: f(*args, **kw))


def load(fmt: str):
    import jaxllm
    from jaxllm import lowbit, quant
    cfg, params, tok = jaxllm.load_model("smollm2", keep_quantized=fmt.startswith("4bit"))
    if fmt == "4bit-a8":
        params = lowbit.round_inputs(params)
    elif fmt == "bfloat16":
        params = quant.decode_weights(params, "bfloat16")
    return cfg, params, tok


def compare(fmt: str, a, in_base: set) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxllm
    from jaxllm.corpus import builtin_corpus
    from pallas_kernels import cpu
    gen = sys.modules["jaxllm.generate"]
    cfg, params, tok = load(fmt)
    ids = tok.encode(builtin_corpus())[:a.prompt]
    filled = jaxllm.generate(params, cfg, jnp.asarray([ids], jnp.int32),
                             jaxllm.init_cache(cfg, 1, sinks=4, window=1020),
                             jaxllm.SamplingConfig(max_new_tokens=1)).cache
    sc = jaxllm.SamplingConfig(max_new_tokens=a.new)
    prompt, lens = jnp.asarray([[ids[-1]]], jnp.int32), jnp.ones((1,), jnp.int32)
    names = {"base": {n: getattr(cpu, n) + ("_base" if n in in_base else "")
                      for n, _ in HANDLERS},
             "new": {n: getattr(cpu, n) for n, _ in HANDLERS}}
    loop = gen._generate_jit.__wrapped__
    jits = {k: jax.jit(traced_apart(loop), static_argnames=("cfg", "rule", "width"),
                       donate_argnames=("cache",)) for k in names}
    original = {n: getattr(cpu, n) for n, _ in HANDLERS}

    def run(k):
        cache = jax.tree.map(lambda x: x.copy(), filled)
        jax.block_until_ready(cache)
        for n, t in names[k].items():  # read when the loop is traced (its first call) only
            setattr(cpu, n, t)
        try:
            args = gen.loop_args(params, cfg, sc, prompt, lens, cache, jax.random.key(0))
            t0, c0 = time.perf_counter(), time.process_time()
            out = jits[k](*args)
            jax.block_until_ready(out)
            wall, used = time.perf_counter() - t0, time.process_time() - c0
        finally:
            for n, t in original.items():
                setattr(cpu, n, t)
        return wall / a.new * 1e3, used / a.new * 1e3, np.asarray(out[0])

    first = {k: run(k)[2] for k in names}  # traces and compiles each
    for k in names:  # each program calls its own build's kernels, and only those
        args = gen.loop_args(params, cfg, sc, prompt, lens, filled, jax.random.key(0))
        called = set(re.findall(r"custom_call @(jaxllm_\w+)", jits[k].lower(*args).as_text()))
        if not called or not called <= set(names[k].values()):
            raise SystemExit(f"kernel_ab: the {k} program calls {sorted(called)}, not only its "
                             f"own build's kernels {sorted(names[k].values())}")
    same = bool((first["base"] == first["new"]).all())
    times = {k: [] for k in names}
    for i in range(a.reps):
        for k in (("base", "new") if i % 2 == 0 else ("new", "base")):
            wall, used, _ = run(k)
            times[k].append((wall, used))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for k, v in times.items()}
    return {"format": fmt, "base": med["base"], "new": med["new"], "same": same,
            "spread": {k: (min(w for w, _ in v), max(w for w, _ in v)) for k, v in times.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare against")
    ap.add_argument("--formats", default="4bit", help="of " + ", ".join(FORMATS))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64, help="tokens decoded per call")
    ap.add_argument("--reps", type=int, default=12, help="calls of each build, alternated")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    formats = a.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            sys.exit(f"unknown format {f!r}: choose from {', '.join(FORMATS)}")
    import jax

    from pallas_kernels import cpu
    if not (cpu.lowbit_available() or cpu.attention_available()):
        sys.exit(f"the CPU kernels are not available here: {cpu.status()}")
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", a.base], check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        lib = ctypes.CDLL(str(build_base(a.base, Path(d))))
    in_base = {name for name, symbol in HANDLERS if hasattr(lib, symbol)}
    for name, symbol in HANDLERS:
        if name in in_base:
            jax.ffi.register_ffi_target(getattr(cpu, name) + "_base",
                                        jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--",
                            "pallas_kernels/csrc"], capture_output=True, text=True).stdout.strip()
    rows = []
    for f in formats:
        r = compare(f, a, in_base)
        (bw, bc), (nw, nc) = r["base"], r["new"]
        rows.append(f"| {f} | {bw:.2f} | {nw:.2f} | {nw / bw:.2f}x | {bc:.1f} | {nc:.1f} | "
                    f"{nc / bc:.2f}x | {r['spread']['base'][0]:.1f}-{r['spread']['base'][1]:.1f}"
                    f" / {r['spread']['new'][0]:.1f}-{r['spread']['new'][1]:.1f} | "
                    f"{'yes' if r['same'] else 'NO'} |")
    table = ("| weights | base ms/token | new ms/token | new / base | base CPU-ms/token | "
             "new CPU-ms/token | new / base (CPU) | wall spread base / new | same tokens |\n"
             "|---|---:|---:|---:|---:|---:|---:|---|---|\n" + "\n".join(rows))
    notes = (f"Medians of {a.reps} generate calls of each build, alternated in one process "
             f"(SmolLM2-135M-Instruct, the file's blocks, StreamingLLM 4+1020 holding a "
             f"{a.prompt}-token prompt, {a.new} tokens a call). base: the kernels at {rev}; "
             f"new: the working tree's" + (" (with uncommitted changes)" if dirty else "") + "."
             + "".join(f" {rev} has no {symbol}: both call the working tree's."
                       for name, symbol in HANDLERS if name not in in_base))
    record("CPU kernels: two builds alternated in one process (smollm2 decode)", table, notes,
           dry=a.no_record)


if __name__ == "__main__":
    main()
