"""How XLA:CPU runs a decode step's products, by weight dtype and formulation (issue 16's bfloat16
and W8 investigation).

For a Pythia-160M MLP matrix (768 x 3072) and its vocabulary head (768 x 50304), one token row
(two or three where stated), each form of ``x @ W`` is timed (best of 20 calls) in a child
process per environment: XLA's defaults, glibc's huge-page malloc (``GLIBC_TUNABLES=
glibc.malloc.hugetlb=1``) and the XLA:CPU library flags that could take a dot (YNNPACK, XNNPACK,
oneDNN). A last row writes a float32 array of the head's size to new memory against writing it
in place (a donated buffer): the cost of a materialised temporary on this machine.

    python benchmarks/cpu_dot_forms.py
    python benchmarks/cpu_dot_forms.py --envs default,hugetlb --no-record
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ENVS = {
    "default": {},
    "hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "ynn dot": {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"},
    "xnnpack": {"XLA_FLAGS": "--xla_cpu_use_xnnpack=true "
                             "--xla_cpu_experimental_xnn_fusion_type=dot"},
    "onednn": {"XLA_FLAGS": "--xla_cpu_use_onednn=true "
                            "--xla_cpu_experimental_onednn_custom_call=true"},
}
SHAPES = {"MLP 768x3072": (768, 3072), "head 768x50304": (768, 50304)}


def child() -> None:
    """Time every form at every shape in this process; print one JSON object."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.weight_only import weight_only_matmul

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _record import best_ms

    rng = np.random.default_rng(0)
    nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),  # noqa: E731
                                          preferred_element_type=jnp.int32)
    out = {}
    for label, (n_in, n_out) in SHAPES.items():
        x = jnp.asarray(rng.standard_normal((1, n_in)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((n_in, n_out)), jnp.float32)
        wb = w.astype(jnp.bfloat16)
        wb_t = jnp.asarray(np.asarray(w).T, jnp.bfloat16)  # [out, in], as QKernel stores int8
        q = jnp.asarray(rng.integers(-127, 128, (n_out, n_in)), jnp.int8)  # [out, in], as stored
        s = jnp.asarray(rng.random(n_out) / 127, jnp.float32)
        xq = jnp.asarray(rng.integers(-127, 128, (3, n_in)), jnp.int8)
        forms = {
            "float32 dot": (lambda x, w: x @ w, x, w),
            "bfloat16 dot (bf16 x bf16)": (lambda x, w: x.astype(jnp.bfloat16) @ w, x, wb),
            "bfloat16 [in, out] converted, float32 dot": (
                lambda x, w: x @ w.astype(jnp.float32), x, wb),
            "bfloat16 [out, in] converted, x @ w.T": (
                lambda x, w: x @ w.astype(jnp.float32).T, x, wb_t),
            "int8 dequantized whole, einsum (W8 before)": (
                lambda x, q, s: jnp.einsum("mi,oi->mo", x, q.astype(jnp.float32) * s[:, None]),
                x, q, s),
            "int8, jaxllm W8 (weight_only_matmul)": (weight_only_matmul, x, q, s),
            "int8 x int8 -> int32, 1 row": (nt, xq[:1], q),
            "int8 x int8 -> int32, 3 rows": (nt, xq, q),
        }
        out[label] = {name: best_ms(jax.jit(f), *args) for name, (f, *args) in forms.items()}
    big = jnp.ones((50304, 768), jnp.float32)
    fresh = jax.jit(lambda a: a * 2)
    out["write 154 MiB"] = {"to new memory": best_ms(fresh, big)}
    inplace = jax.jit(lambda a: a * 2, donate_argnums=0)
    big = inplace(big)
    t_best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        big = jax.block_until_ready(inplace(big))
        t_best = min(t_best, time.perf_counter() - t)
    out["write 154 MiB"]["in place (donated)"] = t_best * 1e3
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", default=",".join(ENVS), help="of " + ", ".join(ENVS))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child()
    envs = [e for e in a.envs.split(",") if e]
    for e in envs:
        if e not in ENVS:
            ap.error(f"unknown environment {e!r}; choose from {', '.join(ENVS)}")
    results = {}
    for e in envs:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        for k, v in ENVS[e].items():
            env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
        print(f"== {e}", flush=True)
        res = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                             capture_output=True, text=True)
        results[e] = json.loads(res.stdout.strip().splitlines()[-1])
    first = results[envs[0]]
    rows = ["| shape | form | " + " | ".join(f"{e} (ms)" for e in envs) + " |",
            "|---|---|" + "---:|" * len(envs)]
    for shape, forms in first.items():
        for form in forms:
            rows.append(f"| {shape} | {form} | " +
                        " | ".join(f"{results[e][shape][form]:.2f}" for e in envs) + " |")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _record import record
    record("XLA:CPU products by weight dtype and form (bfloat16 and W8 investigation)",
           "One token row, best of 20 calls, each environment in its own process:\n\n" +
           "\n".join(rows), dry=a.no_record)


if __name__ == "__main__":
    from _record import steady_heap
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
