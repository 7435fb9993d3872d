"""The benchmarks time forms of one computation against each other: each form must compute it."""
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import kv_products  # noqa: E402

from jaxllm.quant import to_bits, widen_bits  # noqa: E402


def test_kv_products_forms_compute_the_same_pass():
    """Every write form leaves the layer a naive per-row write would; every keys, values and
    attend form gives the float64 result of the same (bfloat16-rounded, for bfloat16 forms)
    operands."""
    N, C, q_rows, p_rows, dh = 4, 32, 3, 1, 8
    forms = kv_products.forms(N, C, q_rows, p_rows, dh)

    def f64(a):  # float32 values; a bfloat16 layer's uint16 bits (cache.Bf16Bits) as values
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
