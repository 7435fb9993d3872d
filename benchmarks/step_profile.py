"""Where a decode step's time goes: one call of ``jaxllm.generate``'s compiled loop per (format,
cache, batch), traced by XLA:CPU's profiler, each executed HLO op classed as a jaxllm CPU kernel
call (the int8 product, the decode attention), another large op (reading 256 KiB or more: XLA's
products, its passes over the cache) or a small op (norms, rotations, dequantizing scales, residual
adds, sampling: ops that read next to nothing).

Why: the roofline (benchmarks/roofline.py) prices a step's bytes at the machine's read rate. A
step whose reads ran at that rate would still take longer by the small ops, which XLA:CPU runs
between the large ones: their share of a step is a part that no faster read removes, and this
table measures it.

Each op's time is its traced span summed over the call's forwards (the prompt's and one per
generated token, ``steps + 1``) and divided by them. The profiler adds a little to every op, so
the traced ms/forward is shown beside the same call's untraced one.

    python benchmarks/step_profile.py                         # Pythia-160M shapes, batch 1
    python benchmarks/step_profile.py --formats w8a8 --caches 252 --batch 1,8 --no-record
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib
import json
import os
import re
import sys
import tempfile
import time
from typing import NamedTuple, Optional

if __name__ == "__main__":  # the per-op trace events need this flag before XLA starts (read
    # once per process); imported (by the tests), the process's environment is left alone
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_enable_xprof_traceme=true").strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import best_ms, full_ring, record, steady_heap, time_generate  # noqa: E402
from roofline import FORMATS, LABELS, NOW_BYTES, variant  # noqa: E402

KERNELS = {"jaxllm_int8_rows": "int8 kernel", "jaxllm_int8_rows_token": "int8 kernel",
           "jaxllm_decode_attention": "attention kernel"}
# An op that reads less than this (its operands' bytes) is a small op: norms, rotations, scales,
# sampling. Products and passes over the cache read a weight or a layer's cache, 0.5 MiB or more
# at Pythia-160M's smallest (a 768 x 768 int8 weight).
SMALL_BYTES = 256 << 10
CLASSES = ("int8 kernel", "attention kernel", "other large ops", "small ops")
CONTAINERS = ("while", "conditional", "call")  # their spans hold their bodies' ops
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
              "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def type_bytes(hlo_type: str) -> int:
    """Bytes of an HLO result type: an array (``f32[1,768]{1,0}``) or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", hlo_type):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += ITEM_BYTES.get(dtype, 0) * n
    return total


# Ops that touch only part of their first operand: a slice of it (an embedding lookup) or an
# in-place write into it (a cache write), which reads none of the rest.
SLICES = ("gather", "dynamic-slice", "slice")
IN_PLACE = ("scatter", "dynamic-update-slice")
PASS = ("convert", "bitcast", "bitcast-convert", "reshape", "copy")


class Instr(NamedTuple):
    name: str
    opcode: str
    operands: tuple  # the operands' names, in order
    nbytes: int  # the result's
    calls: Optional[str]  # a fusion's computation
    param: Optional[int]  # a parameter's number


def parse_hlo(hlo_text: str) -> dict[str, list[Instr]]:
    """A compiled module's HLO text as its computations' instructions, by computation name."""
    head_re = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$")
    line_re = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
    comps: dict[str, list[Instr]] = {}
    current: list[Instr] = []
    for line in hlo_text.splitlines():
        head = head_re.match(line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        m = line_re.match(line)
        if not m:
            continue
        name, rtype, opcode, rest = m.groups()
        args = rest.split(")", 1)[0]
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        current.append(Instr(name, opcode, tuple(re.findall(r"%([\w.\-]+)", args)),
                             type_bytes(rtype), calls.group(1) if calls else None,
                             int(args) if opcode == "parameter" and args.isdigit() else None))
    return comps


def read_bytes(instr: Instr, size: dict[str, int], comps: dict[str, list[Instr]]) -> int:
    """The bytes an op reads: each operand's, except one that the op (or, for a fusion, every
    use of it inside the fused computation) only slices (then the slices' bytes) or writes into
    in place (then nothing)."""
    if instr.calls is None or instr.calls not in comps:
        uses = {0: [instr]} if instr.opcode in SLICES + IN_PLACE else {}
        return sum(part_read(size.get(o, 0), uses.get(i)) for i, o in enumerate(instr.operands))
    body = comps[instr.calls]
    users: dict[str, list] = collections.defaultdict(list)  # name -> (user, operand number)
    for x in body:
        for pos, o in enumerate(x.operands):
            users[o].append((x, pos))

    # The uses of a value, looked through elementwise unary ops: a fused convert computes only
    # the elements that a slice after it takes.
    def ends(name: str):
        for x, pos in users[name]:
            if x.opcode in PASS:
                yield from ends(x.name)
            else:
                yield x if pos == 0 else None
    params = {x.param: x.name for x in body if x.param is not None}
    return sum(part_read(size.get(o, 0), list(ends(params[i])) if i in params else None)
               for i, o in enumerate(instr.operands))


def part_read(nbytes: int, users) -> int:
    """An operand's ``nbytes`` read in full, unless every user (``None``: a use as another
    operand than the first) slices it or writes into it in place."""
    if not users or any(u is None or u.opcode not in SLICES + IN_PLACE for u in users):
        return nbytes
    return min(nbytes, sum(u.nbytes for u in users if u.opcode in SLICES))


def op_classes(hlo_text: str) -> dict[str, tuple[str, int]]:
    """Each instruction of a compiled module's HLO text (``Compiled.as_text()``) by name: (its
    class, the bytes it reads: ``read_bytes``). Classes: the jaxllm kernel it calls; "container"
    (while, conditional, call: timed through their bodies' ops); "small ops" when it reads less
    than SMALL_BYTES; else "other large ops" (XLA's products, its passes over the cache)."""
    comps = parse_hlo(hlo_text)
    size = {x.name: x.nbytes for body in comps.values() for x in body}
    targets = dict(re.findall(r'%?([\w.\-]+)\s*=.*custom_call_target="([^"]+)"', hlo_text))
    out = {}
    for body in comps.values():
        for x in body:
            nbytes = read_bytes(x, size, comps)
            if targets.get(x.name) in KERNELS:
                out[x.name] = KERNELS[targets[x.name]], nbytes
            elif x.opcode in CONTAINERS:
                out[x.name] = "container", 0
            else:
                out[x.name] = ("small ops" if nbytes < SMALL_BYTES else "other large ops"), nbytes
    return out


def op_spans(trace_events: list, module: str) -> list[tuple[str, float]]:
    """(HLO op name, µs) of every op executed in ``module`` in a Chrome/Perfetto trace's events:
    the complete ("X") events that name an ``hlo_op``; the "end: ..." markers that close an
    op run asynchronously are left out (their op's own span is counted)."""
    spans = []
    for e in trace_events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or args.get("hlo_module") != module or "hlo_op" not in args:
            continue
        if str(e.get("name", "")).startswith("end:"):
            continue
        spans.append((args["hlo_op"], float(e["dur"])))
    return spans


def breakdown(spans, classes: dict[str, tuple[str, int]], forwards: int
              ) -> dict[str, tuple[float, float, int]]:
    """Per class: (ms per forward, ops per forward, bytes read per forward). Ops of a container
    (a while loop's span, which holds its body's ops) are skipped."""
    ms, n, nbytes = collections.Counter(), collections.Counter(), collections.Counter()
    for op, us in spans:
        c, b = classes[op]
        if c == "container":
            continue
        ms[c] += us / 1e3
        n[c] += 1
        nbytes[c] += b
    return {c: (ms[c] / forwards, n[c] / forwards, nbytes[c] // forwards) for c in CLASSES}


def profile_generate(params, cfg, cache, steps: int):
    """(the classes' breakdown, traced ms per forward, untraced ms per forward, cache) for one
    call of generate's compiled loop writing ``steps`` tokens per row (``steps + 1`` forwards:
    a one-token prompt, then a token at a time)."""
    import jax
    import jax.numpy as jnp

    import jaxllm
    gen = importlib.import_module("jaxllm.generate")  # the module (jaxllm.generate is the function)

    untraced = float("inf")
    for _ in range(3):  # compiles and warms up first; the fastest of 3 calls
        ms, cache = time_generate(params, cfg, cache, steps)
        untraced = min(untraced, ms)
    sc = jaxllm.SamplingConfig(max_new_tokens=steps)
    prompt = jnp.ones((cache.batch, 1), jnp.int32)
    lens = jnp.ones((cache.batch,), jnp.int32)
    key = jax.random.key(0)
    # The traced call and the text must be one program: the loop is called with the very
    # arguments it is lowered with (jaxllm.generate would pad the prompt to its bucket, a
    # program of other shapes whose ops are numbered otherwise).
    text = gen._generate_jit.lower(*gen.loop_args(params, cfg, sc, prompt, lens, cache, key)
                                   ).compile().as_text()
    classes = op_classes(text)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            cache = gen._generate_jit(*gen.loop_args(params, cfg, sc, prompt, lens, cache,
                                                     key))[2]
            jax.block_until_ready(cache)
            traced = (time.perf_counter() - t0) / (steps + 1) * 1e3
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = op_spans(events, "jit__generate_jit")
    if not spans:
        raise RuntimeError("the trace holds no per-op events of jit__generate_jit: XLA_FLAGS "
                           "must carry --xla_cpu_enable_xprof_traceme=true before jax starts")
    unnamed = {op for op, _ in spans if op not in classes}
    if unnamed:  # the traced executable is not the one whose text was read
        raise RuntimeError(f"{len(unnamed)} traced ops are not in the compiled module's text, "
                           f"e.g. {sorted(unnamed)[:3]}")
    return breakdown(spans, classes, steps + 1), traced, untraced, cache


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="pythia-160m")
    ap.add_argument("--formats", default=",".join(FORMATS), help="of " + ", ".join(FORMATS))
    ap.add_argument("--caches", default="252,4092", help="window sizes (4 sinks each)")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--steps", type=int, default=20, help="tokens per row of the traced call")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    steady_heap()

    import jax
    import jax.numpy as jnp

    import jaxllm
    from jaxllm.policy import StreamingLLM
    from pallas_kernels import cpu

    cfg0 = jaxllm.PRESETS[a.preset]
    params0 = jaxllm.init_params(cfg0, jax.random.key(0))
    formats = a.formats.split(",")
    models = {name: variant(name, cfg0, params0) for name in formats}
    head = ("| format | cache | batch | ms/forward untraced | ms/forward traced | int8 kernel "
            "ms (calls) | attention kernel ms (calls) | other large ops ms (ops) | small ops "
            "ms (ops) | small ops: of all ops' time | large ops' read GB/s | 512 MiB read GB/s "
            "|")
    rows = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    probe = jnp.ones((NOW_BYTES // 4096, 1024), jnp.float32)
    probe_sum = jax.jit(jnp.sum)
    for W in [int(x) for x in a.caches.split(",")]:
        pc = StreamingLLM(4, 4 + W)
        for B in [int(x) for x in a.batch.split(",")]:
            for name, (cfg, params, kv_dtype) in models.items():
                cache = full_ring(pc.make_cache(cfg, B, 0, dtype=kv_dtype))
                parts, traced, untraced, _ = profile_generate(params, cfg, cache, a.steps)
                now = probe.nbytes / best_ms(probe_sum, probe, n=3) / 1e6  # GB/s, right after
                cells = [f"{ms:.2f} ({n:.0f})" for ms, n, _ in parts.values()]
                share = parts["small ops"][0] / sum(ms for ms, _, _ in parts.values())
                large = [parts[c] for c in CLASSES if c != "small ops"]
                rate = sum(b for _, _, b in large) / sum(ms for ms, _, _ in large) / 1e6
                rows.append(f"| {LABELS[name]} | StreamingLLM 4+{W} | {B} | {untraced:.2f} | "
                            f"{traced:.2f} | " + " | ".join(cells) +
                            f" | {share:.0%} | {rate:.1f} | {now:.1f} |")
                print(rows[-1], flush=True)
    table = "\n".join(rows)
    notes = (f"{a.preset} shapes, random weights, a full StreamingLLM ring; one call of "
             f"jaxllm.generate's compiled loop (a one-token prompt, then {a.steps} tokens per "
             f"row), its {a.steps + 1} forwards traced "
             "(XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true, jax.profiler.trace); each "
             "op's span summed and divided by the forwards. Classes: "
             "the jaxllm CPU kernels (" + cpu.status().replace("\n", "; ") + "); other "
             f"large ops: every other op reading {SMALL_BYTES >> 10} KiB or more (XLA's "
             "products, its passes over the cache); small ops: the rest. XLA may run "
             "independent ops at once, so the classes can sum to more than the traced forward; "
             "the share is of their sum. ms/forward untraced: the same call without the "
             "profiler, fastest of 3 (_record.time_generate). Large ops' read: the bytes the "
             "large ops read (their operands; of a buffer written in place, nothing; of a table "
             "looked up, the rows) over their summed time; 512 MiB read: a float32 sum of 512 "
             "MiB right after the traced call (best of 3), the roofline's read now.")
    record(f"Decode step by op class ({a.preset})", table, notes, dry=a.no_record)


if __name__ == "__main__":
    main()
