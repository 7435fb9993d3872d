"""``jaxllm eval TASK``: StreamEval, passkey, QA, outliers, attention sinks, KV shift."""
from __future__ import annotations

from ..argtypes import COUNT, FRACTION, integer, listof, real
from .common import (CliError, DEFAULT_MODEL, MODEL_HELP, add_keep_quantized_arg, add_policy_args,
                     alpha_value, check_files, check_streamable, flag_names, load, policy,
                     seed_int, sources, write_json)


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


# A passkey stream is built as text in host memory (about 4 bytes a token, then its ids):
# 16.8M tokens is far past any cache, and bounded.
PASSKEY_MOST = 1 << 24


def _passkey_args(p) -> None:
    add_policy_args(p)
    p.add_argument("--lengths", type=listof(integer(1, PASSKEY_MOST)), default=(500, 1000, 2000),
                   help=f"stream lengths (tokens, comma-separated, each at most {PASSKEY_MOST:,})")
    p.add_argument("--depths", type=listof(real(0.0, 1.0)), default=(0, 0.25, 0.5, 0.75, 1),
                   help="key depths in [0, 1], comma-separated")
    p.add_argument("--trials", type=COUNT, default=5, help="keys per length and depth")


def _kv_shift_args(t) -> None:
    t.add_argument("--prompt-tokens", type=COUNT, default=512,
                   help="tokens whose heavy hitters are compared")
    t.add_argument("--stream-tokens", type=COUNT, default=2048,
                   help="tokens streamed through H2O for the perplexity of each set")
    t.add_argument("--bits", type=listof(integer(2, 8)), default=(8, 4, 3, 2),
                   help="KV bit widths, comma-separated: 2, 3, 4 or 8")
    t.add_argument("--heavy", type=FRACTION, default=0.1, help="heavy share of the text (0.1)")
    t.add_argument("--recent", type=FRACTION, default=0.1, help="recent share of the text (0.1)")


def _eval_kv_shift(a, cfg, params, tok):
    from ..corpus import builtin_corpus
    from ..evals.kv_shift import report
    return report(params, cfg, tok.encode(builtin_corpus()), a.out + ".png", a.model, a.bits,
                  a.prompt_tokens, a.heavy, a.recent, a.stream_tokens)


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
        need(0 <= alpha_value(a.alpha, "--alpha") <= 1, f"--alpha must lie in [0, 1], got {a.alpha}")
    if a.task == "kv-shift":
        bad = [b for b in a.bits if b not in (2, 3, 4, 8)]
        need(not bad, f"--bits {bad[0] if bad else ''}: the token format packs 2, 3, 4 or 8 "
                      f"bits, comma-separated (e.g. 8,4,3,2)")


def _eval_outliers(a, cfg, params, tok):
    from ..corpus import builtin_corpus
    from ..evals.outliers import report
    from ..smoothquant import CalibConfig
    return report(params, cfg, tok.encode(builtin_corpus()), a.out + ".png", a.model, a.layer,
                  None if a.alpha is None else alpha_value(a.alpha, "--alpha"),
                  CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len))


def _eval_sinks(a, cfg, params, tok):
    from ..corpus import builtin_corpus
    from ..evals.attention import report
    return report(params, cfg, tok.encode(builtin_corpus()), a.out + ".png", a.model, a.n,
                  a.seq_len, a.eps, a.seed)


def _eval_streameval(a, cfg, params, tok, pc):
    from ..evals.streameval import report
    return report(params, cfg, tok.encode, pc, a.out + ".png", a.model, a.lines, a.bucket,
                  a.seed, not a.quiet, a.chunk)


def _eval_qa(a, cfg, params, tok, pc):
    from ..evals import qa
    try:
        records = qa.read_jsonl(a.data) if a.data else qa.SAMPLE * a.repeat
    except OSError as e:
        raise CliError(str(e)) from None
    return qa.report(params, cfg, tok.encode, pc, a.out + ".png", a.model, records,
                     a.data or "sample", not a.quiet, a.chunk)


def _eval_passkey(a, cfg, params, tok, pc):
    from ..evals.passkey import report
    on_cell = None if a.quiet else (
        lambda n, d, acc: print(f"  {n} tokens, depth {d:.2f}: {acc:.2f}", flush=True))
    return report(params, cfg, tok.encode, pc, a.out + ".png", a.model, list(a.lengths),
                  list(a.depths), a.trials, a.seed, on_cell, a.chunk)


STREAMED = {"streameval": _eval_streameval, "qa": _eval_qa, "passkey": _eval_passkey}


def cmd_eval(a) -> None:
    """StreamEval, passkey, QA and attention-sink analysis; each writes OUT.json and OUT.png."""
    _check_eval_args(a)
    # The outputs first: a finished evaluation must never die on a missing folder, nor
    # replace a file it did not write.
    srcs = sources(a.model) + [p for p in (getattr(a, "data", None),) if p]
    check_files({"--out (.json)": a.out + ".json", "--out (.png)": a.out + ".png"}, srcs)
    cfg, params, tok = load(a.model, keep_quantized=a.keep_quantized)
    try:
        if a.task in STREAMED:
            pc = policy(a)
            check_streamable(cfg, pc)
            rep = STREAMED[a.task](a, cfg, params, tok, pc)
        else:
            rep = {"outliers": _eval_outliers, "sinks": _eval_sinks,
                   "kv-shift": _eval_kv_shift}[a.task](a, cfg, params, tok)
    except ValueError as e:
        raise CliError(flag_names(e)) from None
    for line in rep.lines:
        print(line)
    result = {"model": a.model, "task": a.task, **rep.result}
    print(f"wrote {a.out}.png")
    write_json(a.out + ".json", result, srcs)
