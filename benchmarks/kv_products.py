"""A decode step's work on one layer of a float32 or bfloat16 KV cache on XLA:CPU, by form:
the write of the new token, the scores (keys) and the values product, Pythia-160M's layer
shapes (12 KV heads of 64, one query head each, scored at its 3 RoPE rotations as jaxllm's step
does), batch 1 and 8.

Why: a bfloat16 cache halves the bytes a step reads, but on this CPU its step was slower than a
float32 cache's at 4+4092 (roofline runs 9-11). This splits the step into its three cache
passes and times the forms each could take, so the gap is located and the next form to try is
measured, not guessed:

- write: a float32 scatter (in place); bfloat16 as a select against the slot (jaxllm's form
  before kv.stores.Bf16Bits: one pass over the layer); bfloat16 through the layer's bits as uint32
  pairs (an in-place 32-bit scatter between two bitcasts); the uint16 bits of a bfloat16 layer
  scattered in place (jaxllm's form: kv.stores.Bf16Bits).
- keys: ``k [N, C, Dh] . q [N, rows, Dh]`` contracting Dh, the query rows padded to 4; bfloat16
  with the query as three exact bfloat16 terms (``bf16_terms`` below, jaxllm's form before);
  the bits widened to float32 a few heads at a time (``bits.in_widened_groups``).
- values: ``p [N, rows, C] . v [N, C, Dh]`` contracting C; bfloat16 as three terms (the form
  before); the same in groups of 12 heads; widened to float32 first; values stored transposed,
  ``v [N, Dh, C]``, in the keys' form; the bits by head groups.
- float16 (not widened by XLA:CPU's normalization, so no bits are needed): scattered in place,
  keys and values widened by head groups.
- attend: scores, softmax over the slots and values together. jaxllm's form is the CPU kernel
  (pallas_kernels/csrc/decode_attention.cc: each head's keys and values read once, widened in
  registers) where it is available; without it, one pass by head groups that widens the keys
  and values of a few heads at a time (``in_widened_groups`` over both); the form before that
  was a loop for the scores and one for the values, whose scores array (a loop's output)
  XLA:CPU gave its own memory in every layer.

    python benchmarks/kv_products.py
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _record import best_ms, record, steady_heap  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm.bits import in_widened_groups, to_bits  # noqa: E402
from pallas_kernels import cpu  # noqa: E402

HEADS, DH = 12, 64


def bf16_terms(x):
    """float32 ``x`` [..., r, d] as three bfloat16 row blocks [hi; mid; lo] whose float32 sum is
    exactly ``x`` (each keeps the next 8 significant bits, cut by masking): the form jaxllm's
    decode step took over a bfloat16 cache before kv.stores.Bf16Bits, one bfloat16 x bfloat16
    product of three times the rows."""
    parts = []
    for _ in range(3):
        top = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
        parts.append(top.astype(jnp.bfloat16))
        x = x - top
    return jnp.concatenate(parts, axis=-2)


def sum_terms(y, rows: int, axis: int):
    """The three result blocks of a bf16_terms product (``rows`` each on ``axis``) added."""
    part = lambda i: jax.lax.slice_in_dim(y, i * rows, (i + 1) * rows, axis=axis)  # noqa: E731
    return (part(0) + part(1)) + part(2)


def dot(a, b, ca: int, cb: int):
    """Batched over axis 0, contracting a's axis ``ca`` with b's ``cb``, float32 result."""
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((0,), (0,))),
                               preferred_element_type=jnp.float32)


def write_ms(fn, layer, *rest, n: int = 10) -> float:
    """Best of ``n`` calls of a write, the layer donated and threaded through (as a decode step
    does: XLA may then update it in place)."""
    import time
    f = jax.jit(fn, donate_argnums=0)
    layer = f(layer, *rest)
    layer.block_until_ready()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        layer = f(layer, *rest)
        layer.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def forms(N: int, C: int, q_rows: int = 1, p_rows: int = 1, dh: int = DH):
    """{(pass, form): (fn, args)}; every fn returns what the step needs from that pass. ``N``:
    batch x KV heads; ``q_rows``: query rows a KV head scores (jaxllm: 3 rotations of each of
    its query heads under RoPE); ``p_rows``: its query heads."""
    ks = jax.random.split(jax.random.key(0), 4)
    k32, v32 = (jax.random.normal(k, (N, C, dh)) for k in ks[:2])
    k16, v16 = k32.astype(jnp.bfloat16), v32.astype(jnp.bfloat16)
    kbits, vbits = to_bits(k32), to_bits(v32)
    kh, vh = k32.astype(jnp.float16), v32.astype(jnp.float16)
    vt16 = jnp.swapaxes(v16, 1, 2)  # [N, Dh, C]
    q = jax.random.normal(ks[2], (N, q_rows, dh))
    p = jax.nn.softmax(jax.random.normal(ks[3], (N, p_rows, C)), -1)
    slot = jnp.full((N,), C // 2, jnp.int32)
    new = q[:, 0]

    def pad4(x):
        return jnp.pad(x, ((0, 0), (0, -x.shape[1] % 4), (0, 0)))

    def write_select(layer, slot, new):
        hit = jnp.arange(C)[None, :, None] == slot[:, None, None]
        return jnp.where(hit, new[:, None, :].astype(layer.dtype), layer)

    def write_pairs(layer, slot, new):
        u = jax.lax.bitcast_convert_type(layer.reshape(N, C, dh // 2, 2), jnp.uint32)
        nu = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16).reshape(N, dh // 2, 2),
                                          jnp.uint32)
        u = u.at[jnp.arange(N), slot].set(nu, mode="drop")
        return jax.lax.bitcast_convert_type(u, jnp.bfloat16).reshape(N, C, dh)

    def values_groups(p, v):
        t = bf16_terms(p)
        return sum_terms(jnp.concatenate([dot(t[i:i + 12], v[i:i + 12], 2, 1)
                                          for i in range(0, N, 12)]), p_rows, 1)

    def attend(k, v, q):  # scores, softmax over the slots, values: [N, p_rows, Dh]
        s = dot(k, pad4(q), 2, 2)[..., :p_rows]  # [N, C, p_rows]
        return dot(jax.nn.softmax(jnp.swapaxes(s, 1, 2), -1), v, 2, 1)

    def attend_two_loops(k, v, q):  # jaxllm's form before: a loop for scores, one for values
        s = in_widened_groups(lambda k, q: dot(k, q, 2, 2), k, pad4(q))[..., :p_rows]
        p = jax.nn.softmax(jnp.swapaxes(s, 1, 2), -1)
        return in_widened_groups(lambda v, p: dot(p, v, 2, 1), v, p)

    def attend_one_pass(k, v, q):  # jaxllm's form without the kernel: attention.decode.attend_cache
        return in_widened_groups(attend, (k, v), q)

    # The CPU kernel (pallas_kernels/csrc/decode_attention.cc) computes the same pass: it scores
    # each slot against the one rotation jaxllm's pick names (here the first, as ``attend``
    # keeps) and divides by sqrt(Dh), which the query undoes.
    pick = jnp.zeros((1, C), jnp.int32)

    def attend_kernel(k, v, q):
        return cpu.decode_attention(k, v, q * dh ** 0.5, pick, p_rows)
    kernel = {}
    if cpu.attention_available():
        kernel = {("attend", "float32, CPU kernel (jaxllm)"): (attend_kernel, (k32, v32, q)),
                  ("attend", "bfloat16 bits, CPU kernel (jaxllm)"): (
                      attend_kernel, (kbits, vbits, q)),
                  ("attend", "float16, CPU kernel (jaxllm)"): (attend_kernel, (kh, vh, q))}

    return {
        ("write", "float32 scatter"): (
            lambda l, s, x: l.at[jnp.arange(N), s].set(x, mode="drop"), (k32, slot, new)),
        ("write", "bfloat16 select (before)"): (write_select, (k16, slot, new)),
        ("write", "bfloat16 as uint32 pairs"): (write_pairs, (k16, slot, new)),
        ("write", "bfloat16 bits scatter (jaxllm)"): (
            lambda l, s, x: l.at[jnp.arange(N), s].set(to_bits(x), mode="drop"),
            (kbits, slot, new)),
        ("write", "float16 scatter (jaxllm)"): (
            lambda l, s, x: l.at[jnp.arange(N), s].set(x.astype(l.dtype), mode="drop"),
            (kh, slot, new)),
        ("keys", "float32"): (lambda k, q: dot(k, pad4(q), 2, 2), (k32, q)),
        ("keys", "bfloat16, 3 terms (before)"): (
            lambda k, q: sum_terms(dot(k, pad4(bf16_terms(q)), 2, 2), q_rows, 2), (k16, q)),
        ("keys", "bfloat16 bits by head groups"): (
            lambda k, q: in_widened_groups(lambda k, q: dot(k, q, 2, 2), k, pad4(q)), (kbits, q)),
        ("keys", "float16 by head groups"): (
            lambda k, q: in_widened_groups(lambda k, q: dot(k, q, 2, 2), k, pad4(q)), (kh, q)),
        ("values", "float32"): (lambda p, v: dot(p, v, 2, 1), (p, v32)),
        ("values", "bfloat16, 3 terms (before)"): (
            lambda p, v: sum_terms(dot(bf16_terms(p), v, 2, 1), p_rows, 1), (p, v16)),
        ("values", "bfloat16, 3 terms, 12 heads a product"): (values_groups, (p, v16)),
        ("values", "bfloat16 widened to float32"): (
            lambda p, v: dot(p, v.astype(jnp.float32), 2, 1), (p, v16)),
        ("values", "bfloat16 stored [Dh, C], keys' form"): (
            lambda p, v: sum_terms(dot(v, pad4(bf16_terms(p)), 2, 2), p_rows, 2), (p, vt16)),
        ("values", "bfloat16 bits by head groups"): (
            lambda p, v: in_widened_groups(lambda v, p: dot(p, v, 2, 1), v, p), (p, vbits)),
        ("values", "float16 by head groups"): (
            lambda p, v: in_widened_groups(lambda v, p: dot(p, v, 2, 1), v, p), (p, vh)),
        ("attend", "float32, one pass (without the kernel)"): (attend_one_pass, (k32, v32, q)),
        ("attend", "bfloat16 bits, two loops (before)"): (attend_two_loops, (kbits, vbits, q)),
        ("attend", "bfloat16 bits, one pass by head groups (without the kernel)"): (
            attend_one_pass, (kbits, vbits, q)),
        ("attend", "float16, two loops (before)"): (attend_two_loops, (kh, vh, q)),
        ("attend", "float16, one pass by head groups (without the kernel)"): (
            attend_one_pass, (kh, vh, q)),
        **kernel,
    }


# The forms jaxllm's decode step takes (cache.write_token, attention.decode.attend_cache), by cache dtype
# (a bfloat16 cache on CPU: kv.stores.Bf16Bits); attention by the CPU kernel where it is available.
_KERNEL = cpu.attention_available()
JAXLLM_FORMS = {"float32": ("float32 scatter", "float32, CPU kernel (jaxllm)" if _KERNEL else
                            "float32, one pass (without the kernel)"),
                "bfloat16": ("bfloat16 bits scatter (jaxllm)",
                             "bfloat16 bits, CPU kernel (jaxllm)" if _KERNEL else
                             "bfloat16 bits, one pass by head groups (without the kernel)"),
                "float16": ("float16 scatter (jaxllm)",
                            "float16, CPU kernel (jaxllm)" if _KERNEL else
                            "float16, one pass by head groups (without the kernel)")}


def step_passes_ms(N: int, C: int, dtype: str, q_rows: int, p_rows: int, dh: int) -> float:
    """One layer's cache passes in a decode step, in jaxllm's forms: the keys' and the values'
    writes, and the scores-softmax-values pass (best of 10 each, summed)."""
    f = forms(N, C, q_rows, p_rows, dh)
    write, attend = (f[step, form] for step, form in zip(("write", "attend"),
                                                         JAXLLM_FORMS[dtype]))
    return (2 * write_ms(write[0], write[1][0].copy(), *write[1][1:]) +
            best_ms(jax.jit(attend[0]), *attend[1], n=10))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    lines = ["| pass | form | batch | ms per layer | x float32's |", "|---|---|---:|---:|---:|"]
    for B in [int(b) for b in a.batch.split(",")]:
        base = {}
        for (step, form), (fn, args) in forms(B * HEADS, a.slots, q_rows=3).items():
            ms = (write_ms(fn, args[0].copy(), *args[1:]) if step == "write" else
                  best_ms(jax.jit(fn), *args, n=10))
            base.setdefault(step, ms)  # each pass's float32 form comes first
            lines.append(f"| {step} | {form} | {B} | {ms:.2f} | {ms / base[step]:.1f}x |")
            print(lines[-1], flush=True)
    record(f"KV cache passes by form, one layer ({HEADS} KV heads x {DH}, {a.slots} slots)",
           "Best of 10 calls each (a write's layer donated and threaded through, as in a "
           "decode step):\n\n"
           + "\n".join(lines), dry=a.no_record)


if __name__ == "__main__":
    steady_heap()  # before XLA starts its threads: see _record.steady_heap
    main()
