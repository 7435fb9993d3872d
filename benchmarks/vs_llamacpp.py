"""jaxllm against llama.cpp on the same GGUF file and the same prompt ids, on this CPU.

Every measurement is a fresh process (so load time and peak memory are its own), the two
programs alternated run by run: jaxllm in each weight format (float32 as loaded, bfloat16,
int8 weight-only W8, the file's 4-bit blocks kept, and kept with their inputs rounded to 8
bits as llama.cpp's are, 4bit-a8: jaxllm.lowbit.round_inputs) with a dense and a StreamingLLM
4+1020 cache (float16 by default, as llama.cpp's own cache is: ``--kv-dtypes``), and llama.cpp
through llama-cpp-python, which is never a jaxllm dependency: build it in an environment of
its own and pass that environment's Python,

    python -m venv ~/llama-env && ~/llama-env/bin/pip install llama-cpp-python==0.3.36
    python benchmarks/vs_llamacpp.py --llama-python ~/llama-env/bin/python

On an Intel CPU that lists AMX under a hypervisor that does not grant it, the native build
stops with SIGILL at its first tile load (``tileloadd``): build it without AMX,
``CMAKE_ARGS="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"`` before ``pip``.

Greedy decoding from the same prompt ids (the first --prompt tokens of the embedded corpus). A
run reports load seconds, prefill tokens/s, decode tokens/s over --new tokens (the first
token's time, which holds the prefill, left out), CPU-seconds per decoded token (user + system
of all its threads: the steady figure on a shared machine) and its peak RSS. Compilation is
done before the timed calls (a warm-up of the same shapes). Beside them, the weight-read floor:
the bytes of weights one decode step reads over this machine's measured read rate.

``--parts chat``: the peak RSS of a chat of a few questions, ``jaxllm chat`` as a user runs it
(a first run with an empty cache directory, then a second) against llama.cpp's chat completion,
and each turn's latency: from the question to the answer's first text.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = ("float32", "bfloat16", "w8", "4bit", "4bit-a8")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_mib() -> float:
    """This process's peak resident memory: VmHWM, which starts afresh at exec (ru_maxrss keeps
    the high-water mark of the process it was forked from, here the parent's loaded model)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- workers (one process each) ----------------------------------------------------------------

def worker_jaxllm(a) -> dict:
    sys.path.insert(0, os.path.dirname(HERE))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxllm
    from jaxllm import lowbit, quant
    ids = json.load(open(a.ids))
    t0 = time.perf_counter()
    cfg, params, tok = jaxllm.load_model(a.gguf, keep_quantized=a.format.startswith("4bit"))
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    if a.format == "bfloat16":
        params = quant.decode_weights(params, "bfloat16")
    elif a.format == "4bit-a8":  # the inputs of the 4-bit products rounded to 8 bits
        params = lowbit.round_inputs(params)
    elif a.format == "w8":
        calib = np.asarray(ids * 4, np.int32)[:4 * 64]
        params = jaxllm.smoothquant.quantize(params, cfg, calib, "w8", smooth=False,
                                             calib=jaxllm.CalibConfig(n_seqs=4, seq_len=64,
                                                                      batch=4))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    prompt = jnp.asarray([ids], jnp.int32)

    dtype = getattr(jnp, a.kv_dtype)

    def cache():
        if a.cache == "dense":
            return jaxllm.init_cache(cfg, 1, sinks=0, window=len(ids) + a.new + 1, ring=False,
                                     dtype=dtype)
        return jaxllm.init_cache(cfg, 1, sinks=4, window=1020, dtype=dtype)

    def run(n):
        out = jaxllm.generate(params, cfg, prompt, cache(), jaxllm.SamplingConfig(
            max_new_tokens=n))
        jax.block_until_ready(out)
        return out

    run(1), run(a.new)  # compile both programs (the budgets 1 and N: two widths)
    c0, t0 = _cpu(), time.perf_counter()
    run(1)
    prefill_s, prefill_cpu = time.perf_counter() - t0, _cpu() - c0
    c0, t0 = _cpu(), time.perf_counter()
    out = run(a.new)
    total_s, total_cpu = time.perf_counter() - t0, _cpu() - c0
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": total_s - prefill_s,
            "decode_cpu_s": total_cpu - prefill_cpu, "peak_mib": _peak_mib(),
            "weight_bytes": weight_bytes,
            "tokens": [int(t) for t in np.asarray(out.tokens[0])]}


def worker_llama(a) -> dict:
    from llama_cpp import Llama
    ids = json.load(open(a.ids))
    t0 = time.perf_counter()
    llm = Llama(model_path=a.gguf, n_ctx=len(ids) + a.new + 16, n_threads=os.cpu_count(),
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0

    def run(n):
        out = []
        llm.reset()  # else generate() reuses the cached prompt: no prefill would be timed
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == 1:
                marks.append((time.perf_counter(), _cpu()))
            if len(out) == n:
                break
        marks.append((time.perf_counter(), _cpu()))
        return out

    marks: list = []
    run(2)  # warm-up
    marks = [(time.perf_counter(), _cpu())]
    out = run(a.new)
    (t0, c0), (t1, c1), (t2, c2) = marks
    return {"load_s": load_s, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "decode_cpu_s": c2 - c1, "peak_mib": _peak_mib(), "tokens": out,
            "weight_bytes": os.path.getsize(a.gguf)}  # the file's (with its vocabulary)


QUESTIONS = ("What is the capital of France?", "Name three colors.",
             "Write one sentence about the sea.", "What is two plus two?",
             "Say hello in Spanish.")


class _TurnClock:
    """Times a chat's turns from outside it: when each question is handed over (its line read),
    when the answer's first text appears and when the answer ends (the line after it)."""

    def __init__(self, questions, out):
        self.questions, self.out = list(questions), out
        self.asked: list = []
        self.first: list = []
        self.ended: list = []

    def __iter__(self):  # stdin for ``jaxllm chat``: a question a line
        for q in self.questions:
            self.close()
            self.asked.append(time.perf_counter())
            yield q + "\n"
        self.close()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        if len(self.ended) < len(self.asked):
            self.ended.append(time.perf_counter())

    def write(self, text: str) -> int:  # stdout of ``jaxllm chat``: the answers' pieces
        if (text.strip() and not text.startswith(">>> ")
                and len(self.first) < len(self.asked)):
            self.first.append(time.perf_counter())
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def turns(self) -> dict:
        return {"first_token_s": [f - a for a, f in zip(self.asked, self.first)],
                "answer_s": [e - a for a, e in zip(self.asked, self.ended)]}


class _TokenCounts:
    """stderr for ``jaxllm chat``: passed on, and each answer's token count read from the line
    the chat prints after it ("[N tokens, ...")."""

    def __init__(self, out):
        self.out, self.counts = out, []

    def write(self, text: str) -> int:
        self.counts += [int(n) for n in re.findall(r"^\[(\d+) tokens", text, re.M)]
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return False


def worker_jaxllm_chat(a) -> dict:
    """``jaxllm chat`` as a user runs it (its defaults: the file's blocks, StreamingLLM), the
    QUESTIONS typed in, in this process: its peak RSS is the command's; each turn timed from
    its question to the answer's first text."""
    sys.path.insert(0, os.path.dirname(HERE))
    from jaxllm.cli import main
    clock, counts = _TurnClock(QUESTIONS, sys.stderr), _TokenCounts(sys.stderr)
    sys.stdin, stdout, stderr = clock, sys.stdout, sys.stderr
    sys.stdout, sys.stderr = clock, counts
    try:
        rc = main(["chat", "--model", a.gguf, "--max-new-tokens", str(a.new)])
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    if rc:
        raise SystemExit(f"jaxllm chat exited {rc}")
    return {"peak_mib": _peak_mib(), **clock.turns(), "answer_tokens": counts.counts}


def worker_llama_chat(a) -> dict:
    """llama.cpp's chat completion over the same QUESTIONS, each answer kept in the history
    (llama-cpp-python keeps the cache of the prompt's common prefix, so a turn feeds its own
    tokens only), streamed: each turn timed from its question to the answer's first text."""
    from llama_cpp import Llama
    llm = Llama(model_path=a.gguf, n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
    messages: list = []
    first, answer, tokens = [], [], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        t0, parts = time.perf_counter(), []
        for chunk in llm.create_chat_completion(messages=messages, max_tokens=a.new,
                                                temperature=0.0, stream=True):
            delta = chunk["choices"][0]["delta"]
            piece = delta.get("content") or ""
            if piece.strip() and len(first) < len(answer) + 1:
                first.append(time.perf_counter() - t0)
            if "content" in delta:  # a chunk a token (the first names the role only)
                parts.append(piece)
        answer.append(time.perf_counter() - t0)
        tokens.append(len(parts))
        messages.append({"role": "assistant", "content": "".join(parts)})
    return {"peak_mib": _peak_mib(), "first_token_s": first, "answer_s": answer,
            "answer_tokens": tokens}


def chat_memory(a) -> None:
    """Peak RSS of a chat and its turns' latency, each run a fresh process: llama.cpp's, and
    jaxllm chat's first run (an empty cache directory: the file converted, the programs
    compiled) and second (both read from that directory), runs alternated."""
    import shutil

    from _record import machine, record
    import tempfile

    from jaxllm.chat import BURST
    runs: dict = {"llama.cpp": [], "jaxllm chat, first run": [], "jaxllm chat, second run": []}
    for rep in range(a.repeats):
        runs["llama.cpp"].append(spawn(a.llama_python, "llama-chat", a))
        home = tempfile.mkdtemp(prefix="jaxllm-cache-")
        try:
            env = dict(os.environ, JAXLLM_CACHE_DIR=home)
            for key in ("jaxllm chat, first run", "jaxllm chat, second run"):
                runs[key].append(spawn(sys.executable, "jaxllm-chat", a, env=env))
        finally:
            shutil.rmtree(home, ignore_errors=True)
        print(f"run {rep + 1}: " + ", ".join(f"{k} {v[-1]['peak_mib']:.0f} MiB"
                                             for k, v in runs.items()), file=sys.stderr)
    base = statistics.median(r["peak_mib"] for r in runs["llama.cpp"])
    later = lambda rs, key: [x for r in rs for x in r[key][1:]]  # noqa: E731  turns 2 on
    b_first = statistics.median(later(runs["llama.cpp"], "first_token_s"))
    def per_token(rs):  # an answer's text after its first token, ms a token (turns 2 on)
        return statistics.median(
            (e - f) / (n - 1) * 1e3 for r in rs for f, e, n in
            list(zip(r["first_token_s"], r["answer_s"], r["answer_tokens"]))[1:] if n > 1)
    b_tok = per_token(runs["llama.cpp"])
    lines = ["| program | peak RSS MiB (median) | runs | vs llama.cpp | first turn: first text s "
             "| later turns: first text s, median (range) | vs llama.cpp | later answers: ms a "
             "token after the first | vs llama.cpp |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for k, rs in runs.items():
        peaks = [r["peak_mib"] for r in rs]
        m = statistics.median(peaks)
        first1 = statistics.median(r["first_token_s"][0] for r in rs)
        f = later(rs, "first_token_s")
        lines.append(f"| {k} | {m:.0f} | {', '.join(f'{x:.0f}' for x in peaks)} | "
                     f"{m / base:.2f}x | {first1:.2f} | {statistics.median(f):.3f} "
                     f"({min(f):.3f}-{max(f):.3f}) | {statistics.median(f) / b_first:.2f}x | "
                     f"{per_token(rs):.1f} | {per_token(rs) / b_tok:.2f}x |")
    notes = (f"`python benchmarks/vs_llamacpp.py --llama-python ... --parts chat --new {a.new} "
             f"--repeats {a.repeats}` on {machine()}; {os.path.basename(a.gguf)}; the "
             f"{len(QUESTIONS)} questions of the script, greedy, at most {a.new} tokens an "
             f"answer; jaxllm chat with its defaults (the file's 4-bit blocks, StreamingLLM "
             f"4+1020, float16 cache), llama.cpp's create_chat_completion with a 2,048-token "
             f"context (float16 cache), streamed. First text: from a question handed over to "
             f"its answer's first text (the turn's template tokens fed, the first token "
             f"sampled and decoded); jaxllm's first turn holds its programs' compilation (first "
             f"run) or their loading from the cache directory (second run). Ms a token: from "
             f"the answer's first text to its end over its tokens after the first (jaxllm's "
             f"shown {BURST} at a time, its answer's end after its last token is written; "
             f"llama.cpp's one at a time), the median over turns 2 on.")
    record("Peak memory of a chat: jaxllm chat against llama.cpp (same GGUF)",
           "\n".join(lines), notes, dry=a.dry)


LLAMA_FTYPES = {"float32": "LLAMA_FTYPE_ALL_F32", "bfloat16": "LLAMA_FTYPE_MOSTLY_BF16"}


def worker_llama_float(a) -> dict:
    """The GGUF file's weights in a float format, written to ``--out`` by llama.cpp's own
    quantizer (``llama_model_quantize``, the blocks dequantized: the same weights as jaxllm's
    float loads of the file), so that llama.cpp's float speed can stand beside jaxllm's."""
    import ctypes

    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize = getattr(llama_cpp, LLAMA_FTYPES[a.format]), True
    err = os.dup(2)
    try:  # it prints a line a tensor
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        rc = llama_cpp.llama_model_quantize(a.gguf.encode(), a.out.encode(), ctypes.byref(p))
    finally:
        os.dup2(err, 2)
    if rc:
        raise SystemExit(f"llama_model_quantize to {a.format} failed ({rc})")
    return {"bytes": os.path.getsize(a.out)}


def speed_table(a) -> None:
    """Each weight format x KV cache against llama.cpp: load, prefill, decode, CPU, peak RSS;
    and llama.cpp on the file's weights in float32 and bfloat16 (``--llama-floats``)."""
    import shutil
    import tempfile

    from _record import machine, record
    rate = read_rate_gbs()
    runs: dict = {}
    combos = [("llama", "-", "dense")] + [("jaxllm", f, f"{c} {d}")
                                          for f in a.formats.split(",")
                                          for c in a.caches.split(",")
                                          for d in a.kv_dtypes.split(",")]
    floats = {f: None for f in a.llama_floats.split(",") if f}
    where = tempfile.mkdtemp(prefix="llama-floats-")
    try:
        for f in floats:
            floats[f] = os.path.join(where, f"{f}.gguf")
            spawn(a.llama_python, "llama-float", a, format=f, out=floats[f])
        combos[1:1] = [("llama", f, "dense") for f in floats]
        for rep in range(a.repeats):
            for kind, fmt, cache in combos:
                over = ({} if kind == "llama" else
                        dict(cache=cache.split()[0], kv_dtype=cache.split()[1]))
                r = spawn(a.llama_python if kind == "llama" else sys.executable, kind, a,
                          format=fmt, **over,
                          **({"gguf": floats[fmt]} if fmt in floats and kind == "llama" else {}))
                runs.setdefault((kind, fmt, cache), []).append(r)
                print(f"run {rep + 1}: {kind} {fmt} {cache}: decode "
                      f"{(a.new - 1) / r['decode_s']:.1f} tok/s", file=sys.stderr)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    med = lambda key, rs: statistics.median(r[key] for r in rs)  # noqa: E731
    base = runs[("llama", "-", "dense")]
    b_tps, b_cpu = (a.new - 1) / med("decode_s", base), med("decode_cpu_s", base) / (a.new - 1)
    b_pre = a.prompt / med("prefill_s", base)
    lines = ["| program | weights | KV cache | load s | prefill tok/s | decode tok/s | "
             "CPU-ms / token | peak RSS MiB | decode vs llama.cpp | CPU / token vs llama.cpp "
             "| prefill vs llama.cpp | decode vs llama.cpp, same float format | weight-read "
             "floor tok/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tps_of = lambda rs: (a.new - 1) / med("decode_s", rs)  # noqa: E731
    for (kind, fmt, cache), rs in runs.items():
        tps = tps_of(rs)
        cpu = med("decode_cpu_s", rs) / (a.new - 1)
        pre = a.prompt / med("prefill_s", rs)
        floor = (f"{rate * 1e9 / rs[0]['weight_bytes']:.0f}" if "weight_bytes" in rs[0]
                 else "")
        same = ""
        if kind == "jaxllm" and ("llama", fmt, "dense") in runs:
            same = f"{tps / tps_of(runs[('llama', fmt, 'dense')]):.2f}x"
        what = fmt if kind == "jaxllm" else (
            "the file (Q4_1)" if fmt == "-" else f"the file's, {fmt} (llama_model_quantize)")
        lines.append(f"| {'llama.cpp' if kind == 'llama' else 'jaxllm'} | {what} | "
                     f"{'dense float16' if kind == 'llama' else cache} | {med('load_s', rs):.2f} | "
                     f"{pre:.0f} | {tps:.1f} | {cpu * 1e3:.0f} | {med('peak_mib', rs):.0f} | "
                     f"{tps / b_tps:.2f}x | {cpu / b_cpu:.2f}x | {pre / b_pre:.2f}x | {same} | "
                     f"{floor} |")
    def shared(t):  # the greedy answer's first tokens in common with llama.cpp's
        return next((i for i, (x, y) in enumerate(zip(t, base[0]["tokens"])) if x != y),
                    min(len(t), len(base[0]["tokens"])))
    same = ", ".join(f"{'llama.cpp ' + f if k == 'llama' else f} {c}: "
                     f"{min(shared(r['tokens']) for r in rs)}" for (k, f, c), rs in runs.items())
    notes = (f"`python benchmarks/vs_llamacpp.py --llama-python ... --formats {a.formats} "
             f"--caches {a.caches} --kv-dtypes {a.kv_dtypes} --prompt {a.prompt} --new "
             f"{a.new} --repeats {a.repeats}` on {machine()}; {os.path.basename(a.gguf)}; "
             f"medians of {a.repeats} runs alternated; read rate {rate:.1f} GB/s (numpy sums, "
             f"one a core); "
             f"greedy tokens in common with llama.cpp's first answer before they part (the "
             f"fewest of the runs; llama.cpp rounds the activations to 8 bits for its Q4_1 "
             f"products): {same}. Dense: the cache holds the prompt and the answer (llama.cpp's "
             f"own cache, float16); StreamingLLM: 4 sinks + 1,020 slots; the KV cache's dtype "
             f"after its kind (float16: llama.cpp's, and `jaxllm chat`'s default). "
             f"llama.cpp's float rows run the file's weights converted by its own quantizer "
             f"(the blocks dequantized, as jaxllm's float loads of the file are); the same-format "
             f"column compares jaxllm's float32 and bfloat16 rows with them. The floor: the "
             f"weights' bytes (llama.cpp's: its file's size) over the read rate.")
    table = "\n".join(lines)
    record("jaxllm against llama.cpp on the CPU (same GGUF, same prompt)", table, notes,
           dry=a.dry)


# ---- the driver ----------------------------------------------------------------------------------

def read_rate_gbs() -> float:
    """This machine's read rate, GB/s: the fastest sum of a 512 MiB float32 buffer by numpy,
    a part on each core (both programs decode on every core; one core alone read 24 GB/s
    where two read 34 on the 2-core Zen 4 EPYC)."""
    import threading

    import numpy as np
    buf = np.ones(128 << 20, np.float32)
    parts = np.array_split(buf, os.cpu_count() or 1)
    best = float("inf")
    for _ in range(5):
        threads = [threading.Thread(target=p.sum) for p in parts]  # numpy's sum frees the GIL
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def spawn(python: str, kind: str, a, env=None, **over) -> dict:
    args = [python, os.path.abspath(__file__), "--worker", kind, "--gguf", a.gguf, "--ids",
            a.ids, "--new", str(a.new)]
    for k, v in over.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"{kind} {over} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--format", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="streaming", help=argparse.SUPPRESS)
    ap.add_argument("--kv-dtype", default="float16", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help="the GGUF file (default: SmolLM2's, packaged)")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="tokens generated")
    ap.add_argument("--repeats", type=int, default=2, help="alternated runs of each")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--caches", default="dense,streaming")
    ap.add_argument("--kv-dtypes", default="float16",
                    help="jaxllm's KV cache dtypes (comma-separated; default float16, the dtype "
                         "of llama.cpp's own cache and of `jaxllm chat`'s)")
    ap.add_argument("--llama-floats", default="float32,bfloat16",
                    help="llama.cpp also on the file's weights in these float formats (written "
                         "by its quantizer to a temporary directory; '' for none)")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="speed,chat",
                    help="speed: the formats' table; chat: peak memory and turn latency of a chat")
    ap.add_argument("--dry", action="store_true", help="print, do not record")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)))
        return
    if not a.llama_python:
        ap.error("--llama-python is required: a Python with llama-cpp-python (see the docstring)")
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import tempfile

    from jaxllm.corpus import builtin_corpus
    from jaxllm.io import packaged_path
    a.gguf = a.gguf or packaged_path("smollm2")
    from convert.gguf import gguf_tokenizer
    tok = gguf_tokenizer(a.gguf)  # the tokenizer alone: the workers load the weights
    ids = tok.encode(builtin_corpus())[:a.prompt]
    fd, a.ids = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(ids, f)
    parts = a.parts.split(",")
    try:
        if "speed" in parts:
            speed_table(a)
        if "chat" in parts:
            chat_memory(a)
    finally:
        os.unlink(a.ids)


WORKERS = {"jaxllm": worker_jaxllm, "llama": worker_llama, "jaxllm-chat": worker_jaxllm_chat,
           "llama-chat": worker_llama_chat, "llama-float": worker_llama_float}

if __name__ == "__main__":
    main()
