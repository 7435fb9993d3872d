"""Model files: a jaxllm model directory is ``config.json`` + ``model.safetensors``.

``--model`` everywhere accepts such a directory or ``random:PRESET[:SEED]`` (random weights of a
preset architecture from ``jaxllm.PRESETS``, for smoke tests and benchmarks).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from .config import PRESETS, ModelConfig
from .model import init_params
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flatten(v, name + "/") if isinstance(v, dict) else {name: v})
    return out


def _unflatten(flat):
    tree = {}
    for name, arr in flat.items():
        node = tree
        *path, leaf = name.split("/")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = arr
    return tree


def save_model(path: str, cfg: ModelConfig, params, tokenizer: str = "byte") -> None:
    """Write ``path/config.json`` and ``path/model.safetensors`` atomically (temp dir + rename):
    an interrupted save never leaves a half-written model where a good one was."""
    from safetensors.numpy import save_file
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump({"model": cfg.to_dict(), "tokenizer": tokenizer}, f, indent=2, sort_keys=True)
    flat = {k: np.asarray(v) for k, v in _flatten(jax.device_get(params)).items()}
    save_file(flat, os.path.join(tmp, WEIGHTS))
    if os.path.exists(path):  # swap in the new one, then delete the old
        old = tempfile.mkdtemp(prefix=".old-", dir=parent)
        os.rename(path, os.path.join(old, "m"))
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)


def load_model(spec: str) -> tuple[ModelConfig, dict, Tokenizer]:
    """``(cfg, params, tokenizer)`` from a model directory or ``random:PRESET[:SEED]``."""
    if spec.startswith("random:"):
        _, name, *seed = spec.split(":")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r} in {spec!r}; presets: {', '.join(PRESETS)}")
        cfg = PRESETS[name]
        params = init_params(cfg, jax.random.key(int(seed[0]) if seed else 0))
        tok = ByteTokenizer() if cfg.vocab_size == ByteTokenizer.vocab_size else None
        if tok is None:
            raise ValueError(f"preset {name!r} has a {cfg.vocab_size}-token vocabulary and no "
                             f"tokenizer ships with it; use it from Python, or a byte-level preset")
        return cfg, params, tok
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"--model {spec!r}: not a directory; give a jaxllm model directory "
                                f"(config.json + model.safetensors) or random:PRESET")
    cfg_path, w_path = os.path.join(spec, CONFIG), os.path.join(spec, WEIGHTS)
    for p in (cfg_path, w_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"{p} is missing: a jaxllm model directory holds {CONFIG} and "
                                    f"{WEIGHTS} (write one with jaxllm.save_model)")
    with open(cfg_path) as f:
        meta = json.load(f)
    cfg = ModelConfig.from_dict(meta["model"])
    from safetensors.numpy import load_file
    params = _unflatten(load_file(w_path))
    expect = _flatten(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    got = _flatten(params)
    missing, extra = sorted(set(expect) - set(got)), sorted(set(got) - set(expect))
    if missing or extra:
        raise ValueError(f"{w_path} does not match its config: missing {missing}, extra {extra}")
    for name, arr in got.items():
        if arr.shape != expect[name].shape:
            raise ValueError(f"{w_path}: tensor {name} has shape {arr.shape}, the config needs "
                             f"{expect[name].shape}")
    tok_spec = meta.get("tokenizer", "byte")
    if tok_spec != "byte" and not os.path.isabs(tok_spec):
        tok_spec = os.path.join(spec, tok_spec)
    return cfg, jax.tree.map(jnp.asarray, params), load_tokenizer(tok_spec)
