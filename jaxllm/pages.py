"""Host memory for weights on a CPU: buffers the kernel is asked to back with 2 MiB pages.

A decode step reads every weight once, and reads from 2 MiB pages take fewer TLB misses than
from 4 KiB ones (measured: docs/CPU.md, "Weights on 2 MiB pages").
XLA's CPU client keeps an array that starts on a 64-byte boundary as its device buffer, so
weights read or copied into such a buffer, each at a multiple of 64 bytes, stay there.
"""
from __future__ import annotations

import mmap

import jax
import numpy as np

# Bytes of arrays moved into one buffer at a time (on_huge_pages): what a move holds twice.
BATCH = 32 << 20


def huge_buffer(nbytes: int) -> np.ndarray:
    """A new uint8 buffer of ``nbytes`` in anonymous memory the kernel is asked to back with
    2 MiB pages (``MADV_HUGEPAGE``: Linux's transparent huge pages when they are set to
    "madvise" or "always"; elsewhere plain pages), starting on a page boundary."""
    # Private: a shared anonymous mapping (what mmap makes by default) is shmem, whose huge
    # pages are a separate setting (shmem_enabled, usually never).
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            pass
    return np.frombuffer(mm, np.uint8)


def in_batches(sizes: list[int], limit: int) -> list[list[int]]:
    """The indices of ``sizes`` in consecutive batches, each closed once its bytes reach
    ``limit``."""
    out, size = [[]], 0
    for i, n in enumerate(sizes):
        out[-1].append(i)
        size += n
        if size >= limit:
            out.append([])
            size = 0
    return [b for b in out if b]


def at_64(sizes: list[int]) -> tuple[list[int], int]:
    """Where arrays of ``sizes`` bytes start in one buffer, each at a multiple of 64 bytes, and
    the buffer's size."""
    starts, end = [], 0
    for n in sizes:
        starts.append(end)
        end += -(-n // 64) * 64
    return starts, end


def on_huge_pages(params, keep=()):
    """``params`` with its arrays copied into :func:`huge_buffer` buffers about BATCH bytes at
    a time, each source array deleted once copied unless it is one of ``keep`` (the arrays a
    caller still holds): a move holds one batch twice, not the model. Only on the CPU backend
    and for concrete arrays; anything else (a trace, a GPU) gets ``params`` back as it is."""
    leaves, treedef = jax.tree.flatten(params)
    if (jax.default_backend() != "cpu" or not leaves
            or not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                       for x in leaves)):
        return params
    kept = {id(x) for x in jax.tree.leaves(keep)}
    out = list(leaves)
    for batch in in_batches([x.nbytes for x in leaves], BATCH):
        starts, total = at_64([leaves[i].nbytes for i in batch])
        buf = huge_buffer(total)
        views = [_copied(leaves[i], buf, at) for i, at in zip(batch, starts)]
        placed = jax.device_put(views, [leaves[i].sharding for i in batch])
        for i, x in zip(batch, placed):
            if id(leaves[i]) not in kept:
                leaves[i].delete()
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def _copied(x: jax.Array, buf: np.ndarray, at: int) -> np.ndarray:
    """``x``'s values written into ``buf`` from byte ``at``, as an array there (the host view
    of ``x`` gone on return, so ``x`` can be deleted)."""
    host = np.asarray(x)
    view = buf[at:at + host.nbytes].view(host.dtype).reshape(host.shape)
    view[...] = host
    return view
