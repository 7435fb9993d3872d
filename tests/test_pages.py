"""Weights moved onto 2 MiB pages (jaxllm.pages): the same values, each array kept by XLA in the
buffer it was copied into, the buffer marked for huge pages in the kernel's own record of the
mapping (/proc/self/smaps), the moved arrays deleted unless the caller keeps them."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import pages, quant

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU backend's placement")


def smaps_flags(address: int) -> str:
    """The VmFlags line of the mapping that holds ``address``."""
    lines = open("/proc/self/smaps").read().split("\n")
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                return next(x for x in lines[i:] if x.startswith("VmFlags"))
    raise AssertionError(f"{address:x} is in no mapping")


@cpu_only
def test_arrays_move_into_huge_page_buffers_a_batch_at_a_time(monkeypatch):
    monkeypatch.setattr(pages, "BATCH", 2000)
    made = []
    huge_buffer = pages.huge_buffer

    def recorded(n):
        made.append(huge_buffer(n))
        return made[-1]

    monkeypatch.setattr(pages, "huge_buffer", recorded)
    rng = np.random.default_rng(0)
    tree = {"a": jnp.asarray(rng.standard_normal((30, 20)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((7,)), jnp.bfloat16),
            "c": [jnp.asarray(rng.integers(-9, 9, (50, 33)), jnp.int8)]}
    want = jax.tree.map(np.asarray, tree)
    keep = tree["b"]
    moved = pages.on_huge_pages(tree, keep=keep)
    jax.tree.map(np.testing.assert_array_equal, want, jax.tree.map(np.asarray, moved))
    assert len(made) == 2  # 2,400 bytes (past BATCH), then the rest: 14 + 1,650
    spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in made]
    for x in jax.tree.leaves(moved):
        p = x.unsafe_buffer_pointer()
        assert p % 64 == 0 and any(lo <= p < hi for lo, hi in spans)
    assert tree["a"].is_deleted() and tree["c"][0].is_deleted() and not keep.is_deleted()
    if os.path.exists("/proc/self/smaps"):
        assert " hg" in smaps_flags(made[0].ctypes.data)


@cpu_only
def test_decode_weights_puts_its_arrays_on_huge_pages_and_leaves_its_input_alone():
    """Its new arrays (the bfloat16 kernels) are moved; the float32 embedding it hands back as
    it was (astype to its own dtype) is the caller's and stays usable; traced, nothing moves."""
    from conftest import LLAMA

    import jaxllm
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    want = jax.tree.map(np.asarray, params)
    for dtype in ("bfloat16", "float32"):
        out = quant.decode_weights(params, dtype)
        jax.tree.map(np.testing.assert_array_equal, want, jax.tree.map(np.asarray, params))
        q = out["layer_0"]["attn"]["q"]["kernel"].q
        np.testing.assert_array_equal(np.asarray(q), want["layer_0"]["attn"]["q"]["kernel"].T
                                      .astype(jnp.dtype(dtype)))
        if os.path.exists("/proc/self/smaps"):
            assert " hg" in smaps_flags(q.unsafe_buffer_pointer())
    shapes = jax.eval_shape(lambda p: quant.decode_weights(p, "bfloat16"), params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))


@cpu_only
def test_smoothquant_puts_the_model_it_returns_on_huge_pages_and_leaves_its_input_alone():
    """W8 made in the process is decoded from 2 MiB pages too, as a saved W8 model loaded back
    is; the float model it was made from stays the caller's, intact."""
    from conftest import LLAMA

    import jaxllm
    from jaxllm import smoothquant as sq
    params = jaxllm.init_params(LLAMA, jax.random.key(0))
    want = jax.tree.map(np.asarray, params)
    ids = np.random.default_rng(0).integers(0, LLAMA.vocab_size, 4 * 16)
    q = sq.quantize(params, LLAMA, ids, "w8", smooth=False,
                    calib=sq.CalibConfig(n_seqs=2, seq_len=16, batch=2))
    jax.tree.map(np.testing.assert_array_equal, want, jax.tree.map(np.asarray, params))
    codes = q["layer_0"]["mlp"]["up"]["kernel"].q
    assert codes.dtype == jnp.int8
    if os.path.exists("/proc/self/smaps"):
        assert " hg" in smaps_flags(codes.unsafe_buffer_pointer())
