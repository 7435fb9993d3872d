"""The ``jaxllm`` command line: a thin shell over the Python API.

Each command is a pair: ``add_<name>(sub)`` declares its options and ``cmd_<name>(args)`` runs
it (argument checks, the API call, printing and writing the outputs). Commands other packages
provide (``convert``, ``export-hf`` from the convert package) are registered under the
``jaxllm.commands`` entry-point group, so this module never imports them.
"""
from __future__ import annotations

import argparse
import os

from .common import (COMMAND_GROUP, DEFAULT_MODEL, FLAGS, MODEL_HELP, OVERWRITE_HELP, CliError,
                     Parser, check_out, load, run, seed_int, sources)
from .chat import add_chat
from .demo import add_demo
from .eval import add_eval
from .generate import add_generate
from .ppl import add_ppl
from .quantize import add_quantize
from .serve import add_serve

# What the train and convert packages (and scripts) use from the command line.
__all__ = ["COMMANDS", "DEFAULT_MODEL", "MODEL_HELP", "OVERWRITE_HELP", "CliError", "Parser",
           "build_parser", "check_out", "load", "main", "parse", "seed_int", "sources"]

COMMANDS = (add_chat, add_ppl, add_demo, add_generate, add_quantize, add_eval, add_serve)


def plugin_commands() -> list:
    """``add_<name>(sub)`` builders other packages register (group ``jaxllm.commands``; read
    from the checkout's pyproject.toml where jaxllm is not installed, io.plugins)."""
    from ..io import plugins
    return plugins(COMMAND_GROUP)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    p = Parser(prog="jaxllm", description="The jaxllm command line: chat, streaming "
               "perplexity, generation, SmoothQuant and GPTQ, evaluations and conversion (a thin "
               "layer over the Python API).")
    p.add_argument("--version", action="version", version=f"jaxllm {__version__}")
    p.add_argument("--no-compile-cache", action="store_true",
                   default=os.environ.get("JAXLLM_COMPILE_CACHE", "1") == "0",
                   help="do not keep compiled programs between runs (default: kept in "
                        "$JAXLLM_CACHE_DIR/xla or ~/.cache/jaxllm/xla, so a second run of the "
                        "same shapes starts sooner; JAXLLM_COMPILE_CACHE=0 sets this flag)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS + tuple(plugin_commands()):
        add(sub)
    return p


def parse(argv=None) -> argparse.Namespace:
    """The command line parsed and every flag's value validated (jaxllm.argtypes), with no
    work done; bad input raises CliError (one line)."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    """The jaxllm command: compiled programs kept between runs (unless --no-compile-cache), and
    a line on stderr when a large program compiles."""
    from ..progress import (default_cache_dir, say, trimming_after_compiles,
                            use_compile_cache, watch_compiles)

    def start(args):
        if not args.no_compile_cache:
            use_compile_cache(default_cache_dir())

    with watch_compiles(echo=say), trimming_after_compiles():
        return run(build_parser(), argv, lambda args: f"jaxllm {args.cmd}: ", flags=FLAGS,
                   before=start)
