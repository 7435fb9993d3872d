"""The ``jaxllm`` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_MODEL = "random:pythia-tiny"
RANDOM_NOTE = ("note: {model} has random weights, so its perplexities and text are noise; "
               "pass --model DIR for a trained model")


class CliError(Exception):
    """Bad input: printed as one line, exit status 2."""


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


def _load(model: str):
    from .io import load_model
    try:
        cfg, params, tok = load_model(model)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    if model.startswith("random:"):
        print(RANDOM_NOTE.format(model=model), file=sys.stderr)
    return cfg, params, tok


def cmd_ppl(a) -> None:
    from .corpus import builtin_corpus
    from .ppl import PplConfig, plot_nll, run_ppl
    if a.method in ("dense", "window"):
        sinks = a.sinks or 0
    else:
        sinks = (4 if a.method == "streaming" else 0) if a.sinks is None else a.sinks
    try:
        pc = PplConfig(method=a.method, sinks=sinks, cache=a.cache, chunk=a.chunk)
    except ValueError as e:
        raise CliError(str(e)) from None
    text = read_text(a.text) if a.text else builtin_corpus()
    cfg, params, tok = _load(a.model)
    ids = tok.encode(text)
    if a.max_tokens:
        if a.max_tokens < 2:
            raise CliError("--max-tokens must be >= 2")
        ids = ids[:a.max_tokens]
    if len(ids) < 2:
        raise CliError("the text has fewer than 2 tokens: nothing to score")
    nll, summary = run_ppl(params, cfg, ids, pc, progress=not a.quiet)
    summary.update(model=a.model, text=a.text or "builtin")
    line = (f"{pc.method} {summary['sinks']}+{summary['cache'] - summary['sinks']}: "
            f"ppl {summary['ppl']:.3f} over {summary['tokens_scored']} tokens, "
            f"{summary['tokens_per_s']:.0f} tok/s, peak RSS {summary['peak_rss_mb']:.0f} MiB")
    print(line)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {a.json}")
    if a.plot:
        os.makedirs(os.path.dirname(os.path.abspath(a.plot)), exist_ok=True)
        plot_nll(nll, a.plot, f"{a.model} · {line.split(':')[0]} · ppl {summary['ppl']:.2f}")
        print(f"wrote {a.plot}")


def cmd_generate(a) -> None:
    import jax
    import jax.numpy as jnp
    from .cache import init_cache
    from .generate import SamplingConfig, generate
    cfg, params, tok = _load(a.model)
    try:
        sc = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            top_k=a.top_k, top_p=a.top_p, eos_id=tok.eos_id)
        cache = init_cache(cfg, 1, sinks=a.sinks, window=a.cache - a.sinks)
    except ValueError as e:
        raise CliError(str(e)) from None
    key = jax.random.key(a.seed)
    for i, prompt in enumerate(a.prompt):  # each prompt is one round; the cache carries over
        ids = tok.encode(prompt)
        if not ids:
            raise CliError(f"prompt {i + 1} is empty")
        key, sub = jax.random.split(key)
        res = generate(params, cfg, jnp.asarray([ids]), cache, sc, sub)
        cache = res.cache
        n = int(res.num_tokens[0])
        print(f">>> {prompt}\n{tok.decode(list(res.tokens[0, :n]))}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxllm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("ppl", help="streaming perplexity of a text through a cache policy")
    q.add_argument("--model", default=DEFAULT_MODEL,
                   help="jaxllm model directory or random:PRESET[:SEED] (default %(default)s)")
    src = q.add_mutually_exclusive_group()
    src.add_argument("--text", help="UTF-8 text file to score")
    src.add_argument("--corpus", choices=["builtin"], default="builtin",
                     help="the embedded corpus (Python's own documentation; default)")
    q.add_argument("--method", default="streaming",
                   help="dense | window | recompute | streaming (default %(default)s)")
    q.add_argument("--sinks", type=int, default=None,
                   help="sink tokens kept (default 4 for streaming, 0 otherwise)")
    q.add_argument("--cache", type=int, default=1024, help="cache size = sinks + window")
    q.add_argument("--chunk", type=int, default=256, help="tokens per forward call")
    q.add_argument("--max-tokens", type=int, default=0, help="score at most N tokens (0 = all)")
    q.add_argument("--json", help="write the summary here")
    q.add_argument("--plot", help="write the NLL-vs-position plot here (PNG)")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(fn=cmd_ppl)

    g = sub.add_parser("generate", help="generate text; several --prompt are rounds of one chat")
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--prompt", action="append", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sinks", type=int, default=4)
    g.add_argument("--cache", type=int, default=1024)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=cmd_generate)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except CliError as e:
        print(f"jaxllm {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
