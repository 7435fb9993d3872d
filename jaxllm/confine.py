"""Reading only what a model directory holds: every reader resolves the files it opens (weights,
shards, configs, tokenizer files, templates) through :func:`confined`, so a symlink or a path
in a config that leads elsewhere is refused by name instead of read, or copied into an output a
user may publish."""
from __future__ import annotations

import os


def confined(model_dir: str, path: str, named_by: str, what: str = "") -> str:
    """``path`` with symlinks resolved, refused when it leaves ``model_dir`` (an untrusted
    model directory must not make a reader open files elsewhere)."""
    root, real = os.path.realpath(model_dir), os.path.realpath(path)
    if os.path.lexists(path) and not (real == root or real.startswith(root + os.sep)):
        raise ValueError(f"{named_by}: {what or os.path.basename(path)} leads outside the model "
                         f"directory ({path} -> {real}): refusing to read it; copy the file "
                         f"into {model_dir}")
    return real
