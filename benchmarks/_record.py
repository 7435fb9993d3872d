"""Shared by the benchmark scripts: machine description, and recording a table in BENCHMARKS.md."""
from __future__ import annotations

import datetime
import os
import platform
import sys


STEADY_HEAP = False  # set by steady_heap()


def steady_heap() -> bool:
    """Keep XLA:CPU's per-call buffers in glibc's heap; True where glibc took the settings.
    The step-timing scripts call it first, before XLA starts its threads.

    A jitted step called from Python allocates its temporaries on every call. glibc serves a
    block of a few MiB by a fresh mmap or from a heap, depending on the process's allocation
    history: its mmap threshold moves, and there is one heap per thread arena. A fresh mapping
    is faulted in page by page on every call. One decode step with a 4.2 MiB arena took
    28-30 ms instead of 20-21 (1,070 page faults a step), depending on what the process had
    allocated before. That fits the single rows that a multi-format roofline run measured 2-3x
    slow (runs 13-18, docs/BENCHMARKS-ARCHIVE.md).

    The fix: a fixed 32 MiB threshold (glibc's largest), no trimming, and one arena. Then a
    block under 32 MiB stays in the heap, and the same step had no faults at any allocation
    history tried. Not for memory benchmarks: the process keeps what it frees.
    jaxllm's own loops (generate, perplexity) run in one jit and allocate once per call, so
    they do not pay this either way."""
    global STEADY_HEAP
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    STEADY_HEAP = bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and
                       libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1) and
                       libc.mallopt(M_ARENA_MAX, 1))
    return STEADY_HEAP


# JAXLLM_BENCHMARKS_MD redirects the tables (a lent machine writes them where they come back);
# every table also goes to the archive beside it (NAME-ARCHIVE.md).
DOC = os.environ.get("JAXLLM_BENCHMARKS_MD") or os.path.join(os.path.dirname(__file__), "..",
                                                             "docs", "BENCHMARKS.md")


def archive_of(doc: str) -> str:
    root, ext = os.path.splitext(doc)
    return f"{root}-ARCHIVE{ext or '.md'}"


def put_section(doc: str, title: str, block: str) -> None:
    """Replace the section ``## title`` of ``doc`` with ``block`` (or append it), and append
    ``block`` to the archive: the doc keeps the latest table of each benchmark."""
    import re
    text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
    parts = re.split(r"(?m)^(?=## )", text)
    head, sections = parts[0], parts[1:]
    new = block.strip("\n") + "\n\n"
    for i, sec in enumerate(sections):
        if sec.split("\n", 1)[0][3:].strip() == title:
            sections[i] = new
            break
    else:
        sections.append(new)
    with open(doc, "w") as f:
        body = "".join(sec.rstrip("\n") + "\n\n" for sec in sections)
        f.write(head + body.rstrip("\n") + "\n")
    with open(archive_of(doc), "a") as f:
        f.write(block)


def machine() -> str:
    import jax
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = jax.devices()[0]
    acc = "" if dev.platform == "cpu" else f"{dev.device_kind} ({dev.platform}), "
    return (f"{acc}{cpu}, {os.cpu_count()} cores, jax {jax.__version__} "
            f"({jax.default_backend()}), Python {platform.python_version()}"
            + (", glibc heap held (_record.steady_heap)" if STEADY_HEAP else ""))


def best_ms(fn, *args, n: int = 20) -> float:
    """The fastest of ``n`` timed calls of ``fn(*args)`` in ms (called once first, to compile):
    for ceilings and microbenchmarks, where the best call is the bound."""
    import time

    import jax
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def read_ceiling_ms(nbytes: int) -> float:
    """The fastest read of ``nbytes`` in this process: a sum, or a matrix-vector product (Eigen,
    which XLA runs on all cores) over a float32 buffer of that size (best of 20 each)."""
    import jax
    import jax.numpy as jnp
    cols = 1024
    rows = max(1, nbytes // 4 // cols)
    buf = jnp.ones((rows, cols), jnp.float32)
    vec = jnp.ones((cols,), jnp.float32)
    ms = min(best_ms(jax.jit(jnp.sum), buf), best_ms(jax.jit(jnp.dot), buf, vec))
    del buf
    return ms


def full_ring(cache):
    """``cache`` (a sink + ring KV cache) as after a long stream: every slot filled, so a decode
    step attends to all of them, as it does in steady streaming. A fresh cache has its slots
    masked, and the decode-attention kernel skips a masked slot's keys: timed from empty, a
    step would read fewer bytes than the ring holds. The values are whatever the cache holds."""
    import jax.numpy as jnp
    B = cache.length.shape[0]
    return cache.replace(length=jnp.full((B,), cache.capacity, jnp.int32),
                         head=jnp.zeros((B,), jnp.int32))


def time_decode(step, params, cache, steps: int, warmup: int = 2):
    """``(ms per call, cache)`` of ``step(params, tokens=, cache=, lens=)`` decoding one token per
    row of ``cache`` (compiled and warmed up first; the cache is donated and threaded through)."""
    import time

    import jax.numpy as jnp
    B = cache.batch
    tok, lens = jnp.ones((B, 1), jnp.int32), jnp.ones((B,), jnp.int32)
    for _ in range(warmup):
        logits, cache = step(params, tokens=tok, cache=cache, lens=lens)
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, cache = step(params, tokens=tok, cache=cache, lens=lens)
    logits.block_until_ready()
    return (time.perf_counter() - t0) / steps * 1e3, cache


def time_generate(params, cfg, cache, steps: int):
    """``(ms per decode step, cache)`` of ``jaxllm.generate`` writing ``steps`` tokens per row
    of ``cache`` (greedy, from a one-token prompt; compiled first): the decode loop as users run
    it, one jit around a ``while_loop`` with the cache donated. Such a call runs ``steps + 1``
    one-token forwards: the prompt's, then one per loop iteration, the last of which only
    writes the final sampled token to the cache (so the returned cache continues the
    conversation; its logits go unused). The time is divided by those ``steps + 1``.

    A step called from Python once per token (``time_decode``) also pays that call: its ~270
    argument arrays passed in, its outputs allocated, the executable started; inside the loop
    none of that recurs. In a scratch run (Pythia-160M, 4+252, batch 1, steps 11-41 of a call)
    a W8, W8A8 or bfloat16 + KV step took 1.3-4.4 ms less in the loop than called alone in 8 of
    9 rounds (0.7 ms more in one); float32's 23 ms step was level."""
    import time

    import jax
    import jax.numpy as jnp

    import jaxllm
    sc = jaxllm.SamplingConfig(max_new_tokens=steps)
    prompt = jnp.ones((cache.batch, 1), jnp.int32)
    cache = jaxllm.generate(params, cfg, prompt, cache, sc).cache  # compiles
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    cache = jaxllm.generate(params, cfg, prompt, cache, sc).cache
    jax.block_until_ready(cache)
    return (time.perf_counter() - t0) / (steps + 1) * 1e3, cache


def alternated_generate(runs: dict, prompt, new: int, reps: int) -> dict:
    """Decode speed of several (params, cfg) pairs over one prompt, in one process: a
    StreamingLLM 4+1020 cache filled with ``prompt`` [B, T] once, then ``reps`` calls of
    ``jaxllm.generate`` for each pair, ``new`` tokens each from a copy of that cache, the pairs'
    calls alternated (a b, b a, ...: a shared machine's speed swings within minutes).
    {"med": ms a token by name, "spread": (min, max) by name, "same": the fraction of tokens
    the first two pairs' first calls share}."""
    import statistics
    import time

    import jax
    import numpy as np

    import jaxllm
    params, cfg = next(iter(runs.values()))
    filled = jaxllm.generate(params, cfg, prompt, jaxllm.init_cache(cfg, prompt.shape[0],
                                                                    sinks=4, window=1020),
                             jaxllm.SamplingConfig(max_new_tokens=1)).cache
    sc = jaxllm.SamplingConfig(max_new_tokens=new)

    def run(k):
        cache = jax.tree.map(lambda x: x.copy(), filled)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        out = jaxllm.generate(*runs[k], prompt[:, -1:], cache, sc)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / new * 1e3, np.asarray(out.tokens)

    keys = list(runs)
    first = [run(k)[1] for k in keys]  # compiles each
    times = {k: [] for k in keys}
    for i in range(reps):
        for k in (keys if i % 2 == 0 else keys[::-1]):
            times[k].append(run(k)[0])
    return {"med": {k: statistics.median(v) for k, v in times.items()},
            "spread": {k: (min(v), max(v)) for k, v in times.items()},
            "same": float((first[0] == first[1]).mean())}


def record(title: str, table: str, notes: str = "", dry: bool = False) -> None:
    """Print ``table`` and record it with machine, date and command: docs/BENCHMARKS.md's
    section of this title replaced, docs/BENCHMARKS-ARCHIVE.md appended (``dry``: print the
    table and notes only — the scripts' ``--no-record``)."""
    print(table)
    if dry:
        print(notes)
        return
    cmd = " ".join(["python"] + sys.argv)
    block = (f"\n## {title}\n\n- date: {datetime.date.today().isoformat()}\n- machine: {machine()}\n"
             f"- command: `{cmd}`\n\n{table}\n" + (f"\n{notes}\n" if notes else ""))
    put_section(DOC, title, block)
    print(f"recorded in {os.path.normpath(DOC)} (and its archive)")
