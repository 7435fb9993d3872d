"""Parameter trees (nested dicts) addressed by "/"-joined paths, e.g. ``layer_0/attn/q/kernel``.

The one home of the path convention shared by safetensors files, quantization specs, smoothing
groups, sharding rules and the Hugging Face name maps. It sits at the bottom of the import graph
(nothing from jaxllm is imported here), so every package may use it.
"""
from __future__ import annotations

from flax import traverse_util

SEP = "/"


def flatten(tree) -> dict:
    """Nested dicts -> ``{"a/b/c": leaf}``; anything that is not a dict is a leaf."""
    return traverse_util.flatten_dict(tree, sep=SEP)


def unflatten(flat: dict) -> dict:
    """``{"a/b/c": leaf}`` -> nested dicts (the inverse of :func:`flatten`)."""
    return traverse_util.unflatten_dict(flat, sep=SEP)


def get(tree, path: str):
    """The node at ``path``."""
    for key in path.split(SEP):
        tree = tree[key]
    return tree


def keypath_str(keypath) -> str:
    """A ``jax.tree_util`` key path as a "/" path of its dict keys and attribute names (list
    indices, e.g. of an optax state tuple, are skipped)."""
    names = (getattr(k, "key", getattr(k, "name", None)) for k in keypath)
    return SEP.join(str(n) for n in names if isinstance(n, str))
