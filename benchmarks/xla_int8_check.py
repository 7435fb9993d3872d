"""Is XLA's int8 x int8 -> int32 ``dot_general`` exact on this device? (On the H100 here it
returned twice the true product for M=1, K=7, N=5: tests/test_smoothquant.py.)

Checks a grid of small and odd shapes against numpy int64, for the plain product and for the
candidate work-arounds (K zero-padded to a multiple of 4 / 16; operands widened to int32), and
prints which shapes are wrong. Nothing is timed.

    python benchmarks/xla_int8_check.py
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def pad_k(m):
    def f(x, w):
        k = x.shape[1]
        kp = -(-k // m) * m
        return dot(jnp.pad(x, ((0, 0), (0, kp - k))), jnp.pad(w, ((0, 0), (0, kp - k))))
    return f


VARIANTS = {"plain": dot, "K%4 padded": pad_k(4), "K%16 padded": pad_k(16),
            "int32 operands": lambda x, w: dot(x.astype(jnp.int32), w.astype(jnp.int32))}


def main() -> int:
    rng = np.random.default_rng(0)
    shapes = list(itertools.product((1, 7, 16, 37), (7, 8, 16, 33, 129), (5, 17)))
    wrong = {v: [] for v in VARIANTS}
    for M, K, N in shapes:
        x = rng.integers(-127, 128, (M, K), dtype=np.int8)
        w = rng.integers(-127, 128, (N, K), dtype=np.int8)
        want = x.astype(np.int64) @ w.astype(np.int64).T
        for name, fn in VARIANTS.items():
            got = np.asarray(jax.jit(fn)(jnp.asarray(x), jnp.asarray(w)))
            if not np.array_equal(got, want):
                ratio = np.median(got[want != 0] / want[want != 0]) if (want != 0).any() else 0
                wrong[name].append(f"{M}x{K}x{N} (median ratio {ratio:.2f})")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"{len(shapes)} shapes (M x K x N)")
    for name, bad in wrong.items():
        print(f"- {name}: {len(bad)} wrong" + (": " + ", ".join(bad[:40]) if bad else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
