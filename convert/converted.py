"""A GGUF file's conversion kept in the user's cache, so that a second load reads it back
instead of dequantizing the blocks and building the tokenizer again (docs/CPU.md, "Loading a
GGUF file").

An entry is ``$JAXLLM_CACHE_DIR/models/<key>/`` (else ``~/.cache/jaxllm/models``): the converted
weights as a jaxllm model directory (``model/``, written by jaxllm.save_model and read back by
jaxllm.load_model with all its checks) and the tokenizer as ``tokenizers``' own JSON beside its
special tokens and chat template. The key is the file's sha256, whether its blocks were kept
(``keep_quantized``) and a digest of the converter's sources, so a changed file, a changed
converter or the other load form is a new entry, never a stale one. Entries are written whole
into a temporary directory and renamed into place; one that cannot be read is removed and the
file converted again. Only files up to :data:`MAX_FILE_BYTES` are kept (their float32 weights
take ~8x the file of 4-bit blocks on disk); ``JAXLLM_MODEL_CACHE=0`` turns the cache off.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Optional

MAX_FILE_BYTES = 256 << 20
# What decides the converted form: a change to any of these files is a new key.
_SOURCES = ("gguf.py", "gguf_file.py", "hf.py", "families.py", "converted.py",
            "../jaxllm/lowbit.py", "../jaxllm/quant.py", "../jaxllm/io.py", "../jaxllm/config.py")
_TOKENIZER, _META, _MODEL = "tokenizer.json", "tokenizer_meta.json", "model"


def enabled() -> bool:
    return os.environ.get("JAXLLM_MODEL_CACHE", "1").strip().lower() not in ("0", "off",
                                                                              "false", "no")


@functools.cache
def _converter_digest() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in _SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def entry(path: str, keep_quantized: bool) -> Optional[str]:
    """The cache directory of ``path``'s conversion, or None where none is kept (the cache
    off, a file over :data:`MAX_FILE_BYTES`)."""
    from jaxllm.io import file_sha256
    from pallas_kernels.cpu import cache_dir
    if not enabled() or os.path.getsize(path) > MAX_FILE_BYTES:
        return None
    sha = file_sha256(path)
    form = "blocks" if keep_quantized else "float32"
    return os.path.join(cache_dir(), "models", f"{sha[:32]}-{form}-{_converter_digest()}")


def read(where: str, path: str, build_tokenizer: Callable, shapes_only: bool = False):
    """``(cfg, params, tokenizer)`` of a cache entry, or None when there is none or it cannot be
    read (then it is removed). ``build_tokenizer()``: transformers' tokenizer of the file, made
    only if asked for (jaxllm.tokenizer.HFTokenizer.of_backend). ``shapes_only``: the
    parameters as jax.ShapeDtypeStruct leaves, their data left on disk (jaxllm.io.load_model);
    an entry that cannot be read is then left for the load to remove."""
    if not os.path.isdir(where):
        return None
    try:
        from tokenizers import Tokenizer

        from jaxllm.io import load_model
        from jaxllm.tokenizer import HFTokenizer
        cfg, params, _ = load_model(os.path.join(where, _MODEL), shapes_only=shapes_only)
        with open(os.path.join(where, _META), encoding="utf-8") as f:
            meta = json.load(f)
        backend = Tokenizer.from_file(os.path.join(where, _TOKENIZER))
        tok = HFTokenizer.of_backend(backend, os.path.abspath(path), meta["special_tokens"],
                                     meta["chat_template"], build_tokenizer)
    except Exception:  # noqa: BLE001 - any damage to our own cache entry: convert again
        if not shapes_only:
            shutil.rmtree(where, ignore_errors=True)
        return None
    return cfg, params, tok


def write(where: str, cfg, params, tok) -> None:
    """Keep a conversion; a failure (a full disk, a read-only cache) only loses the saving."""
    from jaxllm.io import save_model
    parent = os.path.dirname(where)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError:
        return
    try:
        save_model(os.path.join(tmp, _MODEL), cfg, params, tokenizer=None)
        tok.backend.save(os.path.join(tmp, _TOKENIZER))
        with open(os.path.join(tmp, _META), "w", encoding="utf-8") as f:
            json.dump({"special_tokens": tok.special_tokens,
                       "chat_template": tok.chat_template}, f)
        os.rename(tmp, where)  # whole or not at all; another process's entry may be there
    except (OSError, ValueError):
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
