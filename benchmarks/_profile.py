"""A benchmark's profile in a few lines: one call traced by ``jax.profiler``, the ops it ran
summed by name, the top ones as a table with their share of the traced time, so a run on a lent
GPU brings back the number and its why in one go (benchmarks/on_gpu.sh writes these into $OUT).

On an accelerator the ops are the device's (the events of its ``/device:...`` rows: the
kernels that ran, named by their HLO op where the trace says, else by kernel); on a CPU the host
events that name an HLO op (XLA:CPU's thunks). Each op's time is its events' summed duration;
ops that run at once on several streams can sum to more than the wall time.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import os
import tempfile
import time
from typing import NamedTuple


class OpTime(NamedTuple):
    name: str
    ms: float
    calls: int
    share: float  # of all the ops' summed time


def op_times(trace_dir: str) -> list[OpTime]:
    """The ops of the Perfetto trace under ``trace_dir`` (jax.profiler.trace(...,
    create_perfetto_trace=True)), most time first."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if str(process.get(e.get("pid"), "")).startswith("/device:")]
    if not device:  # a CPU run: XLA:CPU's own ops, on the host's rows
        device = [e for e in spans if "hlo_op" in (e.get("args") or {})]
    ms, calls = collections.Counter(), collections.Counter()
    for e in device:
        name = (e.get("args") or {}).get("hlo_op") or e.get("name", "?")
        ms[name] += float(e["dur"]) / 1e3
        calls[name] += 1
    total = sum(ms.values()) or 1.0
    return [OpTime(n, t, calls[n], t / total) for n, t in ms.most_common()]


def table(ops: list[OpTime], top: int = 15, per: int = 1) -> str:
    """A markdown table of the ``top`` ops, times divided by ``per`` (calls of the traced
    function, to give ms per step), and a last row for the rest."""
    lines = ["| op | ms | calls | share |", "|---|---:|---:|---:|"]
    for o in ops[:top]:
        lines.append(f"| {o.name} | {o.ms / per:.3f} | {o.calls / per:.3g} | {o.share:.1%} |")
    rest = ops[top:]
    if rest:
        lines.append(f"| ({len(rest)} others) | {sum(o.ms for o in rest) / per:.3f} | "
                     f"{sum(o.calls for o in rest) / per:.3g} | {sum(o.share for o in rest):.1%} |")
    return "\n".join(lines)


@contextlib.contextmanager
def profiled(path: str, title: str, per: int = 1, top: int = 15):
    """Trace the block and append its summary to ``path`` (a markdown file) under ``title``;
    ``per``: how many steps the block runs (times are shown per step). A trace that cannot be
    read is said there instead: the benchmark's own numbers never depend on the profiler."""
    import jax
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            yield
        wall = (time.perf_counter() - t0) * 1e3 / per
        try:
            body = table(op_times(d), top, per)
        except (OSError, ValueError, KeyError) as e:
            body = f"(no summary: {type(e).__name__}: {e})"
    with open(path, "a") as f:
        f.write(f"\n## {title}\n\ntraced wall {wall:.3f} ms per step\n\n{body}\n")
