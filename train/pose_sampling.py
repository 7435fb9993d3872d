"""PoSE (Zhu et al. 2024, "PoSE: Efficient Context Window Extension of LLMs via Positional
Skip-wise Training"): train at a short length Lc with position ids that skip, so the model sees
relative distances up to a target Lt at Lc's cost.

The sampling is the authors' code (``train_pose.py: train_preprocess_function_pose``;
docs/METHODS.md §6), which departs from the paper's N chunks: two chunks, the first always
starting at content and position 0 and at most about Lc/2 long, the second taken from further in
the text and shifted to a random offset:

    len_chunk = min(len(ids), Lc)
    chunk 1 = ids[0 : rt1],  rt1 ~ U{1 .. (len_chunk + 1) // 2}
    chunk 2 = ids[lt2 : rt2], rt2 ~ U{len_chunk .. len(ids)}, lt2 = rt2 - (len_chunk - rt1)
    positions = arange(len_chunk), + rt on chunk 2, rt ~ U{0 .. Lt - len_chunk}

A pure function of the ids and the three draws (:func:`pose_sample`) is what the tests check;
:func:`draw` makes the draws from a seeded generator.
"""
from __future__ import annotations

import numpy as np


def draw(rng: np.random.Generator, n_ids: int, Lc: int, Lt: int) -> tuple[int, int, int]:
    """``(rt1, rt2, rt)`` as the authors draw them (inclusive integer ranges)."""
    if Lt <= Lc:
        raise ValueError(f"the target length Lt={Lt} must exceed the training length Lc={Lc}")
    if n_ids < 2:
        raise ValueError(f"a PoSE sample needs at least 2 tokens, got {n_ids}")
    n = min(n_ids, Lc)
    rt1 = int(rng.integers(1, (n + 1) // 2, endpoint=True))
    rt2 = int(rng.integers(n, n_ids, endpoint=True))
    rt = int(rng.integers(0, Lt - n, endpoint=True))
    return rt1, rt2, rt


def pose_batch(rows: np.ndarray, n: int, Lt: int, seed: int, step: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [B, n], positions [B, n])`` from text windows ``rows`` [B, span]: each row's
    draws come from ``default_rng([seed, step, row])``, so a resumed run redraws the same."""
    out = [pose_sample(r, n, *draw(np.random.default_rng([seed, step, i]), len(r), n, Lt))
           for i, r in enumerate(rows)]
    return (np.stack([t for t, _ in out]).astype(np.int32),
            np.stack([p for _, p in out]).astype(np.int32))


def pose_sample(ids: np.ndarray, Lc: int, rt1: int, rt2: int, rt: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids' [n], positions [n])``, n = min(len(ids), Lc): chunk 1 at positions 0..rt1-1,
    chunk 2 at rt1 + rt .. n - 1 + rt."""
    ids = np.asarray(ids)
    n = min(len(ids), Lc)
    if not 1 <= rt1 <= (n + 1) // 2 or not n <= rt2 <= len(ids):
        raise ValueError(f"draws out of range: rt1={rt1} (1..{(n + 1) // 2}), rt2={rt2} "
                         f"({n}..{len(ids)})")
    lt2 = rt2 - (n - rt1)
    out = np.concatenate([ids[:rt1], ids[lt2:rt2]])
    pos = np.arange(n)
    pos[rt1:] += rt
    return out, pos
