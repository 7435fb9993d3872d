"""The ``jaxllm convert`` and ``jaxllm export-hf`` commands.

Registered under the ``jaxllm.commands`` entry-point group (pyproject.toml): ``jaxllm.cli``
finds them without importing this package, so imports only run from convert to jaxllm.
"""
from __future__ import annotations

import os
import sys

from jaxllm.cli.common import MODEL_HELP, OVERWRITE_HELP, CliError, check_out, load, sources


def add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face model directory or a GGUF file "
                                       "to a jaxllm model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="local HF directory (config.json + safetensors)")
    src.add_argument("--gguf", help="GGUF file (llama.cpp; Llama architecture): its tensors "
                                    "dequantized, its tokenizer and chat template kept")
    p.add_argument("--out", required=True, help="jaxllm model directory to write")
    p.add_argument("--format", choices=["orbax", "safetensors"], default="orbax",
                   help="orbax (restorable into a sharding; default) or one safetensors file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="parameter storage dtype")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pytorch_model*.bin (pickle) when no safetensors exist; only for "
                        "files you trust")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_convert)


def cmd_convert(a) -> None:
    import jax
    import jax.numpy as jnp

    from jaxllm.io import save_model
    from jaxllm.tokenizer import has_tokenizer

    src = a.hf or a.gguf
    check_out(a, [src])
    try:
        if a.gguf:
            from .gguf import from_gguf, gguf_tokenizer
            if not os.path.isfile(a.gguf):
                raise FileNotFoundError(f"--gguf {a.gguf}: no such file")
            cfg, params = from_gguf(a.gguf, progress=not a.quiet, dtype=jnp.dtype(a.dtype))
            tok = gguf_tokenizer(a.gguf)
        else:
            from jaxllm.tokenizer import _confined_files
            from .hf import from_hf
            _confined_files(a.hf)  # a tokenizer file leading outside: refused before converting
            cfg, params = from_hf(a.hf, allow_pickle=a.allow_pickle, progress=not a.quiet,
                                  dtype=jnp.dtype(a.dtype))
            tok = a.hf if has_tokenizer(a.hf) else None
        save_model(a.out, cfg, params, tokenizer=tok, format=a.format,
                   overwrite=a.overwrite, sources=[src])
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise CliError(str(e)) from None
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"converted {cfg.family} ({n / 1e6:.1f}M parameters, {cfg.num_layers} layers) "
          f"-> {a.out} [{a.format}]")
    if a.hf and not has_tokenizer(a.hf):
        print(f"note: {a.hf} has no tokenizer files, so neither has {a.out}: text commands will "
              f"ask for one (copy the tokenizer files into {a.out}/tokenizer)", file=sys.stderr)


def add_export_hf(sub) -> None:
    p = sub.add_parser("export-hf", help="write a GPT-NeoX/Llama/Mistral model in HF format")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--out", required=True, help="directory to write (config.json + safetensors)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_export_hf)


def cmd_export_hf(a) -> None:
    from jaxllm.io import TOKENIZER_DIR
    from jaxllm.tokenizer import ByteTokenizer

    from .hf import to_hf
    check_out(a, sources(a.model))
    cfg, params, tok = load(a.model, need_tokenizer=False)
    tok_dir = os.path.join(a.model, TOKENIZER_DIR)
    try:
        to_hf(cfg, params, a.out, tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else None,
              progress=not a.quiet, overwrite=a.overwrite, sources=sources(a.model))
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"wrote {a.out}: load it with transformers.AutoModelForCausalLM.from_pretrained")
    if isinstance(tok, ByteTokenizer):
        print("note: the model uses jaxllm's byte tokenizer (ids = UTF-8 bytes, specials "
              "256-258), which has no transformers equivalent; no tokenizer was written",
              file=sys.stderr)
