"""The ``jaxllm`` command line: a thin shell over the Python API.

Each command is a pair: ``add_<name>(sub)`` declares its options and ``cmd_<name>(args)`` runs
it (argument checks, the API call, printing and writing the outputs). Commands other packages
provide (``convert``, ``export-hf`` from the convert package) are registered under the
``jaxllm.commands`` entry-point group, so this module never imports them.
"""
from __future__ import annotations

import argparse

from .common import (COMMAND_GROUP, DEFAULT_MODEL, FLAGS, MODEL_HELP, OVERWRITE_HELP, CliError,
                     Parser, check_out, load, run, seed_int, sources)
from .demo import add_demo
from .eval import add_eval
from .generate import add_generate
from .ppl import add_ppl
from .quantize import add_quantize

# What the train and convert packages (and scripts) use from the command line.
__all__ = ["COMMANDS", "DEFAULT_MODEL", "MODEL_HELP", "OVERWRITE_HELP", "CliError", "Parser",
           "build_parser", "check_out", "load", "main", "parse", "seed_int", "sources"]

COMMANDS = (add_ppl, add_demo, add_generate, add_quantize, add_eval)


def plugin_commands() -> list:
    """``add_<name>(sub)`` builders other packages register (group ``jaxllm.commands``; read
    from the checkout's pyproject.toml where jaxllm is not installed, io.plugins)."""
    from ..io import plugins
    return plugins(COMMAND_GROUP)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="jaxllm", description="The jaxllm command line: streaming perplexity, "
               "generation, SmoothQuant, evaluations and conversion (a thin layer over the "
               "Python API).")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS + tuple(plugin_commands()):
        add(sub)
    return p


def parse(argv=None) -> argparse.Namespace:
    """The command line parsed and every flag's value validated (jaxllm.argtypes), with no
    work done; bad input raises CliError (one line)."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    return run(build_parser(), argv, lambda args: f"jaxllm {args.cmd}: ", flags=FLAGS)

