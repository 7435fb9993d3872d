"""``jaxllm ppl``: streaming perplexity of a text through a cache policy."""
from __future__ import annotations

import sys


from ..argtypes import SIZE
from .common import (CliError, DEFAULT_MODEL, MODEL_HELP, add_policy_args, add_weights_arg,
                     check_files, check_streamable, load, policy, read_text, sources, write_json)


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
    p.add_argument("--max-tokens", type=_max_tokens, default=DEFAULT_MAX_TOKENS,
                   help="score the text's first N tokens, or all of it ('all')")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--plot", help="write the NLL-vs-position plot here (PNG)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar, no line saying how much of the text is scored")
    p.set_defaults(fn=cmd_ppl)


DEFAULT_MAX_TOKENS = 4096  # minutes on a laptop CPU for SmolLM2; the whole corpus takes hours


def _max_tokens(text: str):
    """--max-tokens: N >= 2, or 'all' (None)."""
    import argparse
    if text == "all":
        return None
    v = SIZE(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"--max-tokens must be >= 2 or 'all', got {text}")
    return v


def cmd_ppl(a) -> None:
    from ..corpus import builtin_corpus
    from ..ppl import plot_nll, run_ppl
    from ..tokenizer import encode_head
    pc = policy(a)
    text = read_text(a.text) if a.text else builtin_corpus()
    srcs = sources(a.model) + ([a.text] if a.text else [])
    check_files({"--json": a.json, "--plot": a.plot}, srcs)
    cfg, params, tok = load(a.model, weights=a.weights, keep_quantized=a.keep_quantized,
                            int8_inputs=a.int8_inputs)
    ids, more = encode_head(tok, text, a.max_tokens)
    if more and not a.quiet:
        print(f"scoring the text's first {a.max_tokens:,} tokens, of its "
              f"{len(text.encode('utf-8')) / 1024:,.0f} KiB (--max-tokens all scores it all)",
              file=sys.stderr)
    if len(ids) < 2:
        raise CliError("the text has fewer than 2 tokens: nothing to score")
    check_streamable(cfg, pc, len(ids))
    nll, summary = run_ppl(params, cfg, ids, pc, progress=not a.quiet, chunk=a.chunk)
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
