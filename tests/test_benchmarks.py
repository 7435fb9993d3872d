"""The benchmarks time forms of one computation against each other: each form must compute it."""
import json
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import gpu_decode  # noqa: E402
import kv_products  # noqa: E402
import prefill_memory  # noqa: E402

from jaxllm.bits import to_bits, widen_bits  # noqa: E402


# kv_products times XLA:CPU's forms of a cache pass (bfloat16 bits, head groups, the CPU kernel)
@pytest.mark.cpu
def test_kv_products_forms_compute_the_same_pass():
    """Every write form leaves the layer a naive per-row write would; every keys, values and
    attend form gives the float64 result of the same (bfloat16-rounded, for bfloat16 forms)
    operands."""
    N, C, q_rows, p_rows, dh = 4, 32, 3, 1, 8
    forms = kv_products.forms(N, C, q_rows, p_rows, dh)

    def f64(a):  # float32 values; a bfloat16 layer's uint16 bits (kv.stores.Bf16Bits) as values
        a = jnp.asarray(a)
        return np.asarray(widen_bits(a) if a.dtype == jnp.uint16 else a.astype(jnp.float32),
                          np.float64)
    for (step, form), (fn, args) in forms.items():
        got = f64(fn(*args))
        if step == "write":
            layer, slot, new = (np.asarray(a) for a in args)
            want = np.array(f64(layer))
            new = jnp.asarray(new)
            want[np.arange(N), slot] = f64(to_bits(new) if layer.dtype == np.uint16 else
                                           new.astype(layer.dtype))
        elif step == "keys":  # [N, C, q_rows (padded)]
            k, q = f64(args[0]), f64(args[1])
            want = np.einsum("nch,nrh->ncr", k, q)
            got = got[..., :q_rows]
        elif step == "attend":  # softmax over the slots of the first p_rows scores, values
            k, v, q = (f64(a) for a in args)
            s = np.einsum("nch,nrh->nrc", k, q)[:, :p_rows]
            e = np.exp(s - s.max(-1, keepdims=True))
            want = np.einsum("nrc,nch->nrh", e / e.sum(-1, keepdims=True), v)
        else:  # [N, p_rows, Dh]
            p, v = f64(args[0]), f64(args[1])
            if v.shape[1] != C:  # stored [Dh, C]
                v = v.transpose(0, 2, 1)
            want = np.einsum("nrc,nch->nrh", p, v)
            if got.shape != want.shape:  # the keys' form returns [N, Dh, rows]
                got = got.transpose(0, 2, 1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{step}: {form}")


# step_profile reads XLA:CPU's HLO names and its profiler's trace
@pytest.mark.cpu
def test_step_profile_classes_ops_of_a_compiled_module():
    """step_profile's classes, checked on a module built to hold one of each: a large product
    inside a while loop, a cache-like in-place write of one row, small elementwise ops and
    (where the CPU kernel runs here) jaxllm's int8 kernel; then the breakdown of a hand-written
    trace against sums done by hand."""
    import jax

    import pallas_kernels as pk
    import step_profile as sp
    from pallas_kernels import cpu

    assert sp.type_bytes("(s32[1,50304]{1,0}, f32[1]{0})") == 4 * 50304 + 4
    assert sp.type_bytes("bf16[2,3]{1,0}") == 12 and sp.type_bytes("pred[]") == 1
    D = 512  # a [D, D] float32 weight: 1 MiB, over SMALL_BYTES; a [1, D] row: 2 KiB, under

    def f(x, w, wq, buf, i):
        def body(c):
            j, y = c
            return j + 1, jnp.tanh(y @ w)
        y = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]
        if cpu.use_for(1, D):
            y = pk.w8a8_matmul_per_token(y, wq, jnp.ones((D,)), None, jnp.float32)
        buf = jax.lax.dynamic_update_slice(buf, y, (i, 0))  # one row into a 1 MiB buffer
        return jnp.exp(y) + 1.0, buf

    args = (jnp.ones((1, D)), jnp.ones((D, D)), jnp.ones((D, D), jnp.int8),
            jnp.zeros((D, D)), jnp.int32(3))
    text = jax.jit(f, donate_argnums=3).lower(*args).compile().as_text()
    classes = sp.op_classes(text)
    lines = {ln.split("=")[0].strip().removeprefix("ROOT ").lstrip("%").strip(): ln
             for ln in text.splitlines() if " = " in ln}
    dots = [n for n, ln in lines.items() if re.search(r"\sdot\(", ln) and n in classes]
    writes = [n for n, ln in lines.items() if "update-slice" in n or "update_slice" in n]
    assert dots and writes, text
    # The product reads the 1 MiB weight; the loop is a container; the row write (in place)
    # and the elementwise ops read a few KiB.
    assert {classes[n] for n in dots} == {("other large ops", D * 4 + D * D * 4)}, \
        [lines[n] for n in dots]
    kinds = {c for c, _ in classes.values()}
    assert "container" in kinds
    assert ("int8 kernel" in kinds) == cpu.use_for(1, D), classes
    exp = [n for n, ln in lines.items() if "exponential(" in ln]
    assert exp and all(classes[n][0] == "small ops" for n in exp)
    # a row, its index and scalars: the 1 MiB buffer it is written into is updated in place
    assert all(classes[n][0] == "small ops" and classes[n][1] < 8 * D for n in writes), \
        [(lines[n], classes[n]) for n in writes]
    # A fusion that looks up one row of a bfloat16 table (widened first, as XLA fuses it: only
    # the row's elements are converted) and adds a vector: the row is read, not the table.
    body = sp.parse_hlo("""
%fused (param_0: bf16[1000,64], param_1: s32[], param_2: f32[64]) -> f32[64] {
  %param_0 = bf16[1000,64]{1,0} parameter(0)
  %wide = f32[1000,64]{1,0} convert(%param_0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = f32[1,64]{1,0} dynamic-slice(%wide, %param_1, %zero), dynamic_slice_sizes={1,64}
  %flat = f32[64]{0} bitcast(%row)
  %param_2 = f32[64]{0} parameter(2)
  ROOT %add = f32[64]{0} add(%flat, %param_2)
}
""")
    assert [x.param for x in body["fused"] if x.opcode == "parameter"] == [0, 1, 2]
    look = sp.Instr("f", "fusion", ("table", "i", "v"), 256, "fused", None)
    size = {"table": 128000, "i": 4, "v": 256}
    assert sp.read_bytes(look, size, body) == 256 + 4 + 256
    write = sp.Instr("w", "dynamic-update-slice", ("table", "v", "i"), 128000, None, None)
    assert sp.read_bytes(write, size, body) == 256 + 4  # the table is written in place
    plain = sp.Instr("p", "add", ("table", "table"), 128000, None, None)
    assert sp.read_bytes(plain, size, body) == 256000

    loop = next(n for n, (c, _) in classes.items() if c == "container")
    prod = dots[0]
    small = exp[0]
    ev = [{"ph": "X", "name": prod, "dur": 30.0, "args": {"hlo_module": "m", "hlo_op": prod}},
          {"ph": "X", "name": prod, "dur": 10.0, "args": {"hlo_module": "m", "hlo_op": prod}},
          {"ph": "X", "name": loop, "dur": 900.0, "args": {"hlo_module": "m", "hlo_op": loop}},
          {"ph": "X", "name": small, "dur": 4.0, "args": {"hlo_module": "m", "hlo_op": small}},
          {"ph": "X", "name": "end: " + prod, "dur": 7.0,
           "args": {"hlo_module": "m", "hlo_op": prod}},
          {"ph": "X", "name": small, "dur": 50.0, "args": {"hlo_module": "n", "hlo_op": small}},
          {"ph": "i", "name": small, "args": {"hlo_module": "m", "hlo_op": small}}]
    spans = sp.op_spans(ev, "m")
    assert sorted(spans) == sorted([(prod, 30.0), (prod, 10.0), (loop, 900.0), (small, 4.0)])
    parts = sp.breakdown(spans, classes, forwards=2)
    # 40 us over 2 forwards, 2 ops, each reading the weight and a row
    assert parts["other large ops"] == (0.02, 1.0, D * 4 + D * D * 4)
    assert parts["small ops"] == (0.002, 0.5, classes[small][1] // 2)
    assert parts["int8 kernel"] == (0.0, 0.0, 0)


def test_prefill_memory_prints_its_table(capsys, monkeypatch):
    """The prefill-memory benchmark runs on any machine (abstract arrays, nothing allocated):
    one Llama-2-7B layer, a short prompt, its table printed, not recorded."""
    monkeypatch.setattr(sys, "argv", ["prefill_memory.py", "--layers", "1", "--shapes",
                                      "1x64", "--no-record"])
    prefill_memory.main()
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 x 64")]
    assert len(row) == 1 and float(row[0].split("|")[2]) > 0, row


def test_gpu_decode_writes_its_records(tmp_path, monkeypatch, capsys):
    """The accelerator decode benchmark, at a tiny preset on this CPU: one record per (weights,
    KV format, batch) in decode.json with the fields the GPU sessions compare, each format's
    cache measured from its arrays (int8 smaller than bfloat16), the table printed; 4-bit
    weights (w4) with the bfloat16 cache."""
    monkeypatch.setattr(sys, "argv", ["gpu_decode.py", "--preset", "llama-tiny", "--window",
                                      "28", "--batch", "1", "--steps", "2", "--kv", "bf16,int8",
                                      "--weights", "bf16,w4", "--attention", "blockwise", "--out",
                                      str(tmp_path), "--no-record", "--profile",
                                      str(tmp_path / "profile.md")])
    gpu_decode.main()
    recs = json.loads((tmp_path / "decode.json").read_text())
    assert [(r["weights"], r["kv"]) for r in recs] == [
        ("bf16", "bfloat16"), ("bf16", "int8 per token"), ("w4", "bfloat16")]
    keys = {"engine", "device", "weights", "kv", "attention", "batch", "cache", "prompt",
            "decode_ms", "prefill_ms", "kv_bytes"}
    assert {r["attention"] for r in recs} == {"blockwise"}
    assert all(keys <= set(r) and r["decode_ms"] > 0 and r["prompt"] == 32 for r in recs), recs
    assert recs[1]["kv_bytes"] < recs[0]["kv_bytes"]
    assert "| jaxllm | bf16 | int8 per token | blockwise | 1 |" in capsys.readouterr().out
    # --profile: a section per row, each with a table of the ops XLA:CPU ran (a fusion or a
    # dot among them: the trace was read, not an empty table).
    prof = (tmp_path / "profile.md").read_text()
    assert prof.count("\n## ") == 3 and "## w4 weights, KV bf16, blockwise attention, batch 1" \
        in prof
    sections = prof.split("\n## ")[1:]
    assert all(re.search(r"^\| (\S*fusion|dot)\S* \| [0-9.]+ \|", sec, re.M) for sec in sections)


def test_profile_summary_sums_a_traces_ops(tmp_path):
    """_profile.op_times on a Perfetto trace written here: the device's kernel events when the
    trace has a /device: row (named by their HLO op where given), the host's HLO-op events
    otherwise; durations summed per op, calls counted; table() per step, the rest summed."""
    import gzip
    import _profile

    def trace(events, name):
        d = tmp_path / name / "plugins" / "profile"
        d.mkdir(parents=True)
        with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
        return str(tmp_path / name)

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    host = [{"ph": "X", "pid": 1, "name": "fusion.1", "dur": 500.0,
             "args": {"hlo_op": "fusion.1"}},
            {"ph": "X", "pid": 1, "name": "PjitFunction", "dur": 9000.0}]
    gpu = [{"ph": "X", "pid": 2, "name": "triton_kernel", "dur": 300.0,
            "args": {"hlo_op": "custom-call.3"}},
           {"ph": "X", "pid": 2, "name": "triton_kernel", "dur": 100.0,
            "args": {"hlo_op": "custom-call.3"}},
           {"ph": "X", "pid": 2, "name": "gemm_kernel", "dur": 100.0},
           {"ph": "i", "pid": 2, "name": "marker"}]
    ops = _profile.op_times(trace(meta + host + gpu, "gpu"))
    assert [(o.name, o.ms, o.calls) for o in ops] == [("custom-call.3", 0.4, 2),
                                                     ("gemm_kernel", 0.1, 1)]
    assert [round(o.share, 6) for o in ops] == [0.8, 0.2]
    assert [(o.name, o.ms) for o in _profile.op_times(trace(meta[:1] + host, "cpu"))] == [
        ("fusion.1", 0.5)]
    table = _profile.table(ops, top=1, per=2).splitlines()
    assert table[2:] == ["| custom-call.3 | 0.200 | 1 | 80.0% |",
                         "| (1 others) | 0.050 | 0.5 | 20.0% |"]


def test_a_record_replaces_its_section_and_appends_the_archive(tmp_path):
    """docs/BENCHMARKS.md keeps the latest table of each benchmark; the archive keeps all."""
    import _record
    doc = tmp_path / "B.md"
    doc.write_text("# B\n\nintro\n\n## a\n\nold a\n\n## b\n\nold b\n")
    _record.put_section(str(doc), "a", "\n## a\n\nnew a\n")
    _record.put_section(str(doc), "c", "\n## c\n\nnew c\n")
    assert doc.read_text() == "# B\n\nintro\n\n## a\n\nnew a\n\n## b\n\nold b\n\n## c\n\nnew c\n"
    assert (tmp_path / "B-ARCHIVE.md").read_text() == "\n## a\n\nnew a\n\n## c\n\nnew c\n"


def test_kernel_ab_traces_each_build_apart():
    """kernel_ab.traced_apart: two jit objects of one function share a trace (what made every
    kernel_ab run compare a build with itself); made apart, each traces what it reads then."""
    import jax
    import jax.numpy as jnp

    import kernel_ab
    read = {"scale": 1.0}

    def f(x):  # reads a value while traced, as a kernel's target name is read
        return x * read["scale"]
    x = jnp.ones(())
    shared = [jax.jit(f), jax.jit(f)]
    apart = [jax.jit(kernel_ab.traced_apart(f)), jax.jit(kernel_ab.traced_apart(f))]
    got = {}
    for name, (a, b) in (("shared", shared), ("apart", apart)):
        read["scale"] = 1.0
        first = float(a(x))
        read["scale"] = 2.0
        got[name] = (first, float(b(x)))
    assert got["shared"] == (1.0, 1.0)  # JAX's behaviour that hid the bug
    assert got["apart"] == (1.0, 2.0)
