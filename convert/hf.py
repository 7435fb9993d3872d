"""Hugging Face checkpoints in and out, without torch.

``from_hf`` reads a local HF directory (``config.json`` + ``*.safetensors``, sharded index
supported) or an in-memory ``transformers`` model; ``to_hf`` writes a GPT-NeoX / Llama / Mistral
directory that ``AutoModelForCausalLM.from_pretrained`` loads. Nothing here executes remote code,
and ``.bin`` (pickle) files are read only with ``allow_pickle=True``, through
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Callable, Iterator, Optional

import jax
import numpy as np

from jaxllm import tree
from jaxllm.config import ModelConfig
from jaxllm.io import ModelReader, atomic_dir, check_params
from jaxllm.confine import confined
from jaxllm.tokenizer import copy_tokenizer

from .families import ALIASES, BASE_PREFIX, NAMES, UnsupportedModel, config_from_hf, config_to_hf

CONFIG = "config.json"
# Buffers some checkpoints carry that are not parameters (recomputed by every implementation).
_BUFFERS = re.compile(r"(\.inv_freq|\.masked_bias|attention\.bias|\.rotary_emb\..*)$")


def is_hf_dir(path: str) -> bool:
    """A directory whose config.json names a transformers ``model_type``."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            cfg = json.load(f)
        return isinstance(cfg, dict) and "model_type" in cfg  # ("model_type" in a string...)
    except (OSError, ValueError):
        return False


# ---- reading tensors ----------------------------------------------------------------------------

class _SafetensorsDir:
    """name -> lazily read array over the directory's safetensors files."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        from safetensors import SafetensorError, safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            from jaxllm.io import read_json
            meta = read_json(confined(path, index, path))
            wm = meta.get("weight_map") if isinstance(meta, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise ValueError(f"{index} has no weight_map of tensor names to shard files "
                                 f"(a dict of strings): the checkpoint's index is damaged; "
                                 f"fetch it again")
            files = sorted(set(wm.values()))
            bad = [n for n in files if os.path.basename(n) != n or n in (".", "..")]
            if bad:
                raise ValueError(f"{index} names shard files outside {path} "
                                 f"({', '.join(bad[:3])}): refusing to read them")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        self.where: dict[str, object] = {}
        for name in files:
            fp = os.path.join(path, name)
            confined(path, fp, path, f"weights file {name}")  # a symlink may point anywhere
            if not os.path.exists(fp):
                raise FileNotFoundError(f"{index} lists {name}, which is missing from {path}")
            try:  # "flax" reads bfloat16 too (numpy cannot); on the CPU to spare accelerators
                with jax.default_device(jax.devices("cpu")[0]):
                    h = stack.enter_context(safe_open(fp, framework="flax"))
                    keys = list(h.keys())
            except SafetensorError as e:
                raise ValueError(f"{fp} is not a valid safetensors file ({e}); the download is "
                                 f"probably truncated or corrupted: fetch it again") from None
            self.where.update({k: (h, fp) for k in keys})

    def names(self):
        return self.where.keys()

    def get(self, name: str) -> np.ndarray:
        h, fp = self.where[name]
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(h.get_tensor(name))
        except Exception as e:  # noqa: BLE001 - the library raises several types
            raise ValueError(f"{fp}: cannot read tensor {name} ({e}); the file is corrupted") \
                from None


def _pickle_dir(path: str, files: list[str]) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ImportError("reading .bin checkpoints needs torch (pip install torch)") from None
    out = {}
    for name in files:
        sd = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
        out.update({k: v.float().numpy() for k, v in sd.items()})
    return out


def _source(path: str, allow_pickle: bool, stack) -> tuple[dict, Callable, Iterator[str]]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; give a local Hugging Face model "
                                f"directory (config.json + *.safetensors)")
    if not is_hf_dir(path):
        raise ValueError(f"{os.path.join(path, CONFIG)} is missing or has no model_type: not a "
                         f"Hugging Face model directory")
    with open(confined(path, os.path.join(path, CONFIG), path)) as f:
        hf_cfg = json.load(f)
    if any(f.endswith(".safetensors") for f in os.listdir(path)):
        src = _SafetensorsDir(path, stack)
        return hf_cfg, src.get, src.names()
    bins = sorted(f for f in os.listdir(path) if f.endswith(".bin") and "training" not in f)
    if not bins:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    if not allow_pickle:
        raise ValueError(f"{path} has only pickle weights ({', '.join(bins)}); loading a pickle can "
                         f"run arbitrary code, so jaxllm refuses unless you trust the file and "
                         f"pass allow_pickle=True (CLI: --allow-pickle)")
    tensors = _pickle_dir(path, bins)
    return hf_cfg, tensors.__getitem__, tensors.keys()


def _from_model(model) -> tuple[dict, Callable, Iterator[str]]:
    """An in-memory transformers model (torch)."""
    sd = model.state_dict()
    return (model.config.to_dict(), lambda n: sd[n].detach().float().cpu().numpy(), sd.keys())


# ---- conversion ---------------------------------------------------------------------------------

def _canonical(name: str, family: str) -> str:
    name = ALIASES.get(family, {}).get(name, name)
    prefix = BASE_PREFIX[family]
    if name.startswith(prefix) or name in ("lm_head.weight", "embed_out.weight"):
        return name
    return prefix + name  # saved from the base model class


def _listing(names, limit=8) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def from_hf(src, *, allow_pickle: bool = False, dtype=np.float32,
            progress: bool = False) -> tuple[ModelConfig, dict]:
    """``(cfg, params)`` from a local HF directory or an in-memory ``transformers`` model.

    Every tensor is checked against the family's name map: missing or unexpected tensors are
    named, and a tensor of the wrong shape is reported with both shapes.
    """
    with contextlib.ExitStack() as stack:
        if isinstance(src, (str, os.PathLike)):
            hf_cfg, get, names = _source(os.fspath(src), allow_pickle, stack)
            where = os.fspath(src)
        else:
            hf_cfg, get, names = _from_model(src)
            where = type(src).__name__
        return from_tensors(hf_cfg, get, names, where, dtype=dtype, progress=progress)


def from_tensors(hf_cfg: dict, get: Callable[[str], np.ndarray], names, where: str, *,
                 dtype=np.float32, progress: bool = False,
                 finish: Optional[Callable[[dict], dict]] = None) -> tuple[ModelConfig, dict]:
    """``(cfg, params)`` from an HF ``config.json`` dict and its tensors by HF name (``get``
    reads one, ``names`` lists them; ``where`` names the source in errors): the conversion
    every source shares (HF directories, in-memory models, GGUF files). ``finish(flat)``: the
    parameters by path, still numpy, changed before they go to JAX; a tensor that ``get``
    gives as a zero-stride broadcast (a placeholder, such as a GGUF linear kept as its blocks,
    which ``finish`` puts in) is never copied out in full."""
    try:
        cfg = config_from_hf(hf_cfg)
    except UnsupportedModel:
        raise
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    names = list(names)
    if cfg.num_layers > len(names):  # before a per-layer name table is built for any count
        raise ValueError(f"{where}: the config says {cfg.num_layers:,} layers, but there are "
                         f"only {len(names):,} tensors")
    entries = NAMES[cfg.family](cfg)
    available = {_canonical(n, cfg.family): n for n in names if not _BUFFERS.search(n)}
    wanted = {e.hf for e in entries}
    missing = [e.hf for e in entries if e.hf not in available and not e.optional]
    extra = set(available) - wanted
    if missing or extra:
        raise ValueError(f"{where}: the tensors do not match a {cfg.family} model with this "
                         f"config; missing: [{_listing(missing)}]; unexpected: "
                         f"[{_listing(extra)}]")
    flat: dict = {}
    it = entries
    if progress:
        from tqdm import tqdm
        it = tqdm(entries, desc="convert", unit="tensor")
    for e in it:
        if e.hf not in available:
            continue  # optional (a tied head)
        a = get(available[e.hf])
        if tuple(a.shape) != e.shape:
            raise ValueError(f"{where}: tensor {e.hf} has shape {tuple(a.shape)}, but the "
                             f"config needs {e.shape}")
        if not jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
            raise ValueError(f"{where}: tensor {e.hf} is {a.dtype.name}, not a float tensor "
                             f"(quantized checkpoints, e.g. GPTQ/bitsandbytes, cannot be "
                             f"converted; use the float model)")
        for path, v in zip(e.ours, e.to_ours(a)):
            flat[path] = v if _placeholder(v) else np.ascontiguousarray(v, dtype=dtype)
    # the name map must fill exactly the model's parameters, each with the model's shape
    check_params(cfg, flat, f"the {cfg.family} name map", {})
    if finish is not None:
        flat = finish(flat)
    # device_put, not jnp.asarray: the latter dispatches a conversion program per tensor
    return cfg, jax.device_put(tree.unflatten(flat))


def _placeholder(v: np.ndarray) -> bool:
    """A shape without data: every stride 0 (np.broadcast_to of one value)."""
    return v.size > 1 and all(st == 0 for st in v.strides)


def to_hf(cfg: ModelConfig, params, out_dir: str, *, tokenizer_dir: str | None = None,
          progress: bool = False, overwrite: bool = False, sources=()) -> None:
    """Write an HF directory (config.json + model.safetensors [+ tokenizer files]) atomically."""
    from jaxllm.io import save_file
    from jaxllm.quant import is_quantized
    hf_cfg = config_to_hf(cfg)
    if is_quantized(params):
        raise ValueError("these params are int8 (jaxllm quantize); export the float model")
    flat = tree.flatten(jax.device_get(params))
    tensors = {}
    entries = NAMES[cfg.family](cfg)
    if progress:
        from tqdm import tqdm
        entries = tqdm(entries, desc="export", unit="tensor")
    for e in entries:
        if e.optional:  # tied head: transformers re-ties it from the embedding
            continue
        a = np.ascontiguousarray(e.to_hf(*(np.asarray(flat[p], np.float32) for p in e.ours)))
        assert a.shape == e.shape, (e.hf, a.shape, e.shape)
        tensors[e.hf] = a
    with atomic_dir(out_dir, overwrite, sources) as tmp:
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir:
            copy_tokenizer(tokenizer_dir, tmp)


# What lets jaxllm.load_model read a Hugging Face directory: registered under the
# "jaxllm.model_readers" entry point (pyproject.toml), so jaxllm never imports this package.
def _load(path: str):
    from jaxllm.tokenizer import has_tokenizer, load_tokenizer
    return (*from_hf(path), load_tokenizer(path) if has_tokenizer(path) else None)


READER = ModelReader(name="Hugging Face", detect=is_hf_dir, load=_load)
