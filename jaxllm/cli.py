"""The ``jaxllm`` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

DEFAULT_MODEL = "embedded"
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


MODEL_HELP = ("jaxllm model directory, Hugging Face model directory (converted on the fly), "
              "embedded / embedded-sink (the models shipped in the package) or "
              "random:PRESET[:SEED]")


OVERWRITE_HELP = ("replace a model that jaxllm wrote at --out before (anything else there is "
                  "always refused)")


def _first_non_finite(params):
    """The first float tensor (by path) holding NaN or inf, or None."""
    import jax.numpy as jnp

    from .io import flatten_tree
    from .quant import to_plain
    for name, x in flatten_tree(to_plain(params)[0]).items():
        if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jnp.isfinite(x).all()):
            return name
    return None


def _load(model: str, need_tokenizer: bool = True):
    from .io import load_model
    try:
        cfg, params, tok = load_model(model)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise CliError(str(e)) from None
    if model.startswith("random:"):
        print(RANDOM_NOTE.format(model=model), file=sys.stderr)
    bad = _first_non_finite(params)
    if bad:
        print(f"warning: {model}: tensor {bad} holds NaN or inf values, so every result will "
              f"be NaN", file=sys.stderr)
    if tok is None and need_tokenizer:
        from convert.hf import is_hf_dir
        where = model if is_hf_dir(model) else os.path.join(model, "tokenizer")
        raise CliError(f"{model} has no tokenizer: copy the Hugging Face tokenizer files "
                       f"(tokenizer.json, tokenizer_config.json, ...) into {where}")
    return cfg, params, tok


def _ppl_config(a):
    """The cache policy of --method/--sinks/--cache/--chunk (sinks default: 4 for streaming)."""
    from .ppl import PplConfig
    if a.method in ("dense", "window"):
        sinks = a.sinks or 0
    else:
        sinks = (4 if a.method == "streaming" else 0) if a.sinks is None else a.sinks
    try:
        return PplConfig(method=a.method, sinks=sinks, cache=a.cache, chunk=a.chunk)
    except ValueError as e:
        raise CliError(str(e)) from None


def _check_streamable(cfg, pc, n_tokens: int = 0) -> None:
    """Before the work: a learned-position model cannot stream or read past its table."""
    from .ppl import check_positions
    try:
        check_positions(cfg, pc, n_tokens)
    except ValueError as e:
        raise CliError(str(e).replace("method ", "--method ").replace("cache <=", "--cache <="))\
            from None


def _make_parent(path: str) -> None:
    """Create the directory ``path`` will be written into (before any work, so a finished
    computation never dies on a missing folder); a clear error when it cannot be made."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create the output directory {parent}: {e.strerror}") from None


def _write_json(path: str, obj) -> None:
    _make_parent(path)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(f"wrote {path}")


def cmd_ppl(a) -> None:
    from .corpus import builtin_corpus
    from .ppl import plot_nll, run_ppl
    pc = _ppl_config(a)
    text = read_text(a.text) if a.text else builtin_corpus()
    for path in (a.json, a.plot):
        if path:
            _make_parent(path)
    cfg, params, tok = _load(a.model)
    ids = tok.encode(text)
    if a.max_tokens:
        if a.max_tokens < 2:
            raise CliError("--max-tokens must be >= 2")
        ids = ids[:a.max_tokens]
    if len(ids) < 2:
        raise CliError("the text has fewer than 2 tokens: nothing to score")
    _check_streamable(cfg, pc, len(ids))
    nll, summary = run_ppl(params, cfg, ids, pc, progress=not a.quiet)
    summary.update(model=a.model, text=a.text or "builtin")
    line = (f"{pc.method} {summary['sinks']}+{summary['cache'] - summary['sinks']}: "
            f"ppl {summary['ppl']:.3f} over {summary['tokens_scored']} tokens, "
            f"{summary['tokens_per_s']:.0f} tok/s, peak RSS {summary['peak_rss_mb']:.0f} MiB")
    print(line)
    if summary["nan_count"]:
        print(f"warning: {summary['nan_count']} of {summary['tokens_scored']} scores are NaN "
              f"(non-finite weights or logits), so the perplexity is NaN", file=sys.stderr)
    if a.json:
        _write_json(a.json, summary)
    if a.plot:
        plot_nll(nll, a.plot, f"{a.model} · {line.split(':')[0]} · ppl {summary['ppl']:.2f}")
        print(f"wrote {a.plot}")


def cmd_demo(a) -> None:
    from .corpus import builtin_corpus
    from .demo import DemoConfig, explain, format_table, run_demo
    models = {}
    for spec in a.model or ["vanilla=embedded", "learnable-sink=embedded-sink"]:
        label, sep, path = spec.partition("=")
        models[label if sep else spec] = _load(path if sep else spec)
    dc = DemoConfig(tokens=a.tokens, cache=a.cache, sinks=a.sinks, int8=not a.no_int8)
    if dc.cache <= dc.sinks:
        raise CliError(f"--cache {dc.cache} must exceed --sinks {dc.sinks}")
    tok = next(iter(models.values()))[2]
    ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
    if len(ids) < 2 * dc.tokens:
        raise CliError(f"--tokens {dc.tokens}: the corpus has {len(ids)} tokens; use at most "
                       f"{len(ids) // 2} (the rest calibrates INT8)")
    # The stream is the corpus' first tokens; INT8 calibrates on its second half.
    res = run_demo(models, ids[:dc.tokens], ids[len(ids) // 2:], dc, a.out)
    print(format_table(res))
    print("\n" + explain(res))
    for label, text in res["generations"].items():
        print(f"\n[{label}, StreamingLLM {dc.sinks}+{64 - dc.sinks}] >>> {dc.prompt}{text}")
    print(f"\nwrote {a.out}/demo.json and {a.out}/demo.png")


def cmd_generate(a) -> None:
    import jax
    import jax.numpy as jnp
    from .cache import init_cache
    from .generate import SamplingConfig, generate
    if a.sinks < 0 or a.cache <= a.sinks:
        raise CliError(f"--cache {a.cache} must exceed --sinks {a.sinks} (>= 0): the window "
                       f"(--cache - --sinks) holds the recent tokens")
    cfg, params, tok = _load(a.model)
    try:
        sc = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            top_k=a.top_k, top_p=a.top_p, eos_id=tok.eos_id)
        if cfg.pos_emb == "learned":  # absolute positions: a dense cache, never a ring
            print(f"note: {cfg.family} cannot stream; using a dense cache of {a.cache} tokens",
                  file=sys.stderr)
            cache = init_cache(cfg, 1, sinks=0, window=a.cache, evict=False)
        else:
            cache = init_cache(cfg, 1, sinks=a.sinks, window=a.cache - a.sinks)
    except ValueError as e:
        raise CliError(str(e)) from None
    key = jax.random.key(a.seed)
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


def _sources(model: str) -> list:
    """The directory a --model reads from (none for embedded and random models)."""
    return [model] if os.path.isdir(model) else []


def _check_out(a, sources) -> None:
    """Refuse an --out that would lose data before any work is done (see check_output_dir)."""
    from .io import check_output_dir
    try:
        check_output_dir(a.out, a.overwrite, sources)
    except ValueError as e:
        raise CliError(str(e)) from None


def cmd_convert(a) -> None:
    import jax
    import jax.numpy as jnp

    from convert import from_hf
    from convert.hf import has_tokenizer

    from .io import save_model
    _check_out(a, [a.hf])
    try:
        cfg, params = from_hf(a.hf, allow_pickle=a.allow_pickle, progress=not a.quiet,
                              dtype=jnp.dtype(a.dtype))
        save_model(a.out, cfg, params, tokenizer=a.hf if has_tokenizer(a.hf) else None,
                   format=a.format, overwrite=a.overwrite, sources=[a.hf])
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise CliError(str(e)) from None
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"converted {cfg.family} ({n / 1e6:.1f}M parameters, {cfg.num_layers} layers) "
          f"-> {a.out} [{a.format}]")
    if not has_tokenizer(a.hf):
        print(f"note: {a.hf} has no tokenizer files, so neither has {a.out}: text commands will "
              f"ask for one (copy the tokenizer files into {a.out}/tokenizer)", file=sys.stderr)


def cmd_export_hf(a) -> None:
    from convert import to_hf

    from .io import TOKENIZER_DIR
    from .tokenizer import ByteTokenizer
    _check_out(a, _sources(a.model))
    cfg, params, tok = _load(a.model, need_tokenizer=False)
    tok_dir = os.path.join(a.model, TOKENIZER_DIR)
    try:
        to_hf(cfg, params, a.out, tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else None,
              progress=not a.quiet, overwrite=a.overwrite, sources=_sources(a.model))
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"wrote {a.out}: load it with transformers.AutoModelForCausalLM.from_pretrained")
    if isinstance(tok, ByteTokenizer):
        print("note: the model uses jaxllm's byte tokenizer (ids = UTF-8 bytes, specials "
              "256-263), which has no transformers equivalent; no tokenizer was written",
              file=sys.stderr)


def cmd_quantize(a) -> None:
    from .corpus import builtin_corpus
    from .io import save_model
    from .smoothquant import CalibConfig, quantize
    from .tokenizer import ByteTokenizer
    _check_out(a, _sources(a.model))
    cfg, params, tok = _load(a.model)
    alpha = a.alpha if a.alpha in (None, "auto") else _float(a.alpha, "--alpha")
    ids = tok.encode(read_text(a.calib_text) if a.calib_text else builtin_corpus())
    try:
        q, info = quantize(params, cfg, ids, a.scheme, alpha, smooth=not a.no_smooth,
                           smooth_down=a.smooth_down, real=not a.fake, bmm=a.int8_attention,
                           per_channel=True if a.per_channel_weights else None,
                           quantize_embedding=not a.float_embedding,
                           quantize_head=not a.float_head,
                           calib=CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len),
                           progress=not a.quiet, return_info=True)
        save_model(a.out, cfg, q, "byte" if isinstance(tok, ByteTokenizer) else tok.name,
                   format=a.format, overwrite=a.overwrite, sources=_sources(a.model))
    except ValueError as e:
        raise CliError(str(e)) from None
    if "losses" in info:
        print("alpha search (held-out loss): " + ", ".join(
            f"{k}: {v:.4f}" for k, v in info["losses"].items()))
    print(f"quantized {a.model} with {a.scheme}"
          + (f", alpha {info['alpha']}" if info["smooth"] else ", no smoothing")
          + f" ({'real int8' if not a.fake else 'fake-quant'}) -> {a.out}")
    if a.json:
        _write_json(a.json, dict(info, model=a.model))


def _float(s: str, flag: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise CliError(f"{flag} must be a number in [0, 1] or 'auto', got {s!r}") from None


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


def cmd_eval(a) -> None:
    """StreamEval, passkey and attention-sink analysis; each writes OUT.json next to OUT.png."""
    from .evals import attention as att
    from .evals import passkey, streameval
    from .evals.common import score_task
    _check_eval_args(a)
    # The output directory first: a finished evaluation must never die on a missing folder.
    _make_parent(a.out)
    cfg, params, tok = _load(a.model)
    result = {"model": a.model, "task": a.task}
    if a.task == "outliers":
        from .corpus import builtin_corpus
        from .smoothquant import CalibConfig, outlier_report, plot_outliers
        try:
            rep = outlier_report(params, cfg, tok.encode(builtin_corpus()), a.layer,
                                 None if a.alpha is None else _float(a.alpha, "--alpha"),
                                 CalibConfig(n_seqs=a.n_seqs, seq_len=a.seq_len))
        except ValueError as e:
            raise CliError(str(e)) from None
        ratio = lambda v: float(v.max() / np.median(v))  # noqa: E731 - outlier strength
        result.update({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in rep.items()},
                      act_max_over_median_before=ratio(rep["act_before"]),
                      act_max_over_median_after=ratio(rep["act_after"]))
        print(f"{rep['layer']}: activation max/median per channel {ratio(rep['act_before']):.1f}"
              f" before smoothing, {ratio(rep['act_after']):.1f} after (alpha {rep['alpha']})")
        plot_outliers(rep, a.out + ".png", a.model)
    elif a.task == "sinks":
        from .corpus import builtin_corpus
        ids = np.asarray(tok.encode(builtin_corpus()), np.int32)
        need = a.n * a.seq_len
        if len(ids) < need:
            raise CliError(f"the corpus has {len(ids)} tokens; --n x --seq-len needs {need}")
        starts = np.random.default_rng(a.seed).integers(0, len(ids) - a.seq_len, a.n)
        maps = att.attention_maps(params, cfg, np.stack([ids[s:s + a.seq_len] for s in starts]))
        result.update(att.sink_metric(maps, 0, a.eps), n=a.n, seq_len=a.seq_len)
        print(f"sink metric (share of heads with mean attention to token 0 > {a.eps}): "
              f"{result['overall']:.2f}; per layer "
              + " ".join(f"{x:.2f}" for x in result["per_layer"]))
        att.plot_maps(maps, a.out + ".png", f"{a.model}: attention over the first 16 tokens, "
                      f"sink metric {result['overall']:.2f}")
    else:
        pc = _ppl_config(a)
        _check_streamable(cfg, pc)
        result.update(method=pc.method, sinks=pc.sinks, cache=pc.cache)
        if a.task == "streameval":
            task = streameval.streameval_task(a.lines, tok.encode, a.seed)
            ok = score_task(params, cfg, task, pc, progress=not a.quiet)
            rows = streameval.accuracy_by_length(task, ok, a.bucket)
            result.update(tokens=int(len(task.ids)), queries=len(ok), accuracy=float(ok.mean()),
                          by_length=rows)
            print(f"StreamEval {pc.method} {pc.sinks}+{pc.cache - pc.sinks}: accuracy "
                  f"{ok.mean():.3f} over {len(ok)} queries, {len(task.ids)} tokens")
            streameval.plot_accuracy(rows, a.out + ".png", f"{a.model} · StreamEval · "
                                     f"{pc.method} {pc.sinks}+{pc.cache - pc.sinks}")
        elif a.task == "qa":
            from .evals import qa
            try:
                records = qa.read_jsonl(a.data) if a.data else qa.SAMPLE * a.repeat
            except (OSError, ValueError) as e:
                raise CliError(str(e)) from None
            task = qa.qa_task(records, tok.encode)
            ok = score_task(params, cfg, task, pc, progress=not a.quiet)
            result.update(data=a.data or "sample", records=len(ok), tokens=int(len(task.ids)),
                          accuracy=float(ok.mean()), correct=[bool(x) for x in ok])
            print(f"streaming QA {pc.method} {pc.sinks}+{pc.cache - pc.sinks}: exact match "
                  f"{ok.mean():.3f} over {len(ok)} answers, {len(task.ids)} tokens")
            qa.plot_running(ok, a.out + ".png", f"{a.model} · streaming QA · {pc.method} "
                            f"{pc.sinks}+{pc.cache - pc.sinks}")
        else:
            lengths, depths = a.lengths_list, a.depths_list
            rng = np.random.default_rng(a.seed)
            grid = np.zeros((len(lengths), len(depths)))
            for i, n in enumerate(lengths):
                for j, d in enumerate(depths):
                    keys = [f"{k:05d}" for k in rng.integers(0, 100_000, a.trials)]
                    grid[i, j] = np.mean([score_task(params, cfg, passkey.passkey_task(
                        n, d, k, tok.encode), pc)[0] for k in keys])
                    if not a.quiet:
                        print(f"  {n} tokens, depth {d:.2f}: {grid[i, j]:.2f}", flush=True)
            result.update(lengths=lengths, depths=depths, trials=a.trials,
                          accuracy=grid.tolist(), mean=float(grid.mean()))
            print(f"passkey {pc.method} {pc.sinks}+{pc.cache - pc.sinks}: mean accuracy "
                  f"{grid.mean():.3f}")
            passkey.plot_heatmap(grid, lengths, depths, a.out + ".png",
                                 f"{a.model} · passkey · {pc.method} "
                                 f"{pc.sinks}+{pc.cache - pc.sinks}")
    print(f"wrote {a.out}.png")
    _write_json(a.out + ".json", result)


class Parser(argparse.ArgumentParser):
    """An argument parser whose help shows every option's default (subcommands inherit it)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="jaxllm", description="The jaxllm command line: streaming perplexity, "
               "generation, SmoothQuant, evaluations and conversion (a thin layer over the "
               "Python API).")
    sub = p.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("ppl", help="streaming perplexity of a text through a cache policy")
    q.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    src = q.add_mutually_exclusive_group()
    src.add_argument("--text", help="UTF-8 text file to score")
    src.add_argument("--corpus", choices=["builtin"], default="builtin",
                     help="score the embedded corpus (Python's own documentation) when no "
                          "--text is given")
    q.add_argument("--method", default="streaming",
                   help="cache policy: dense | window | recompute | streaming")
    q.add_argument("--sinks", type=int, default=None,
                   help="sink tokens kept (None: 4 for streaming, 0 otherwise)")
    q.add_argument("--cache", type=int, default=1024, help="cache size = sinks + window")
    q.add_argument("--chunk", type=int, default=256, help="tokens per forward call")
    q.add_argument("--max-tokens", type=int, default=0, help="score at most N tokens (0 = all)")
    q.add_argument("--json", help="write the summary here")
    q.add_argument("--plot", help="write the NLL-vs-position plot here (PNG)")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(fn=cmd_ppl)

    d = sub.add_parser("demo", help="the main job on the embedded models: dense / window / "
                                     "StreamingLLM / recompute (and INT8) with a plot")
    d.add_argument("--model", action="append", default=None,
                   help="LABEL=MODEL or MODEL, repeatable (default: vanilla=embedded and "
                        "sink=embedded-sink)")
    d.add_argument("--tokens", type=int, default=4096, help="stream length")
    d.add_argument("--cache", type=int, default=128, help="sinks + window")
    d.add_argument("--sinks", type=int, default=4,
                   help="sink tokens of the StreamingLLM and recompute rows")
    d.add_argument("--no-int8", action="store_true", help="skip the SmoothQuant INT8 row")
    d.add_argument("--out", default="demo_out",
                   help="directory for demo.json and demo.png")
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="generate text; several --prompt are rounds of one chat")
    g.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    g.add_argument("--prompt", action="append", required=True,
                   help="text to continue; repeat for several rounds sharing one cache")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy decoding")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens only (0: no limit)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability")
    g.add_argument("--sinks", type=int, default=4, help="sink tokens kept in the cache")
    g.add_argument("--cache", type=int, default=1024, help="cache size = sinks + window")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert a Hugging Face model directory to jaxllm")
    c.add_argument("--hf", required=True, help="local HF directory (config.json + safetensors)")
    c.add_argument("--out", required=True, help="jaxllm model directory to write")
    c.add_argument("--format", choices=["orbax", "safetensors"], default="orbax",
                   help="orbax (restorable into a sharding; default) or one safetensors file")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="parameter storage dtype")
    c.add_argument("--allow-pickle", action="store_true",
                   help="read pytorch_model*.bin (pickle) when no safetensors exist; only for "
                        "files you trust")
    c.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_convert)

    z = sub.add_parser("quantize", help="SmoothQuant W8A8: calibrate, smooth, quantize to int8")
    z.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    z.add_argument("--scheme", default="o1", choices=["o1", "o2", "o3", "w8"],
                   help="o1/o2/o3 as in the paper (W per-tensor; A per-token, per-tensor "
                        "dynamic, per-tensor static), w8 weight-only")
    z.add_argument("--alpha", default=None,
                   help="migration strength in [0, 1], or 'auto' (grid search on held-out "
                        "calibration text); default: the family's value from the paper")
    z.add_argument("--no-smooth", action="store_true", help="naive quantization, no smoothing")
    z.add_argument("--smooth-down", action="store_true",
                   help="SwiGLU: also smooth down_proj's input through up_proj")
    z.add_argument("--per-channel-weights", action="store_true",
                   help="per-output-channel weight scales instead of the scheme's per-tensor")
    z.add_argument("--int8-attention", action="store_true",
                   help="also run the attention products QK^T and PV in INT8")
    z.add_argument("--float-embedding", action="store_true",
                   help="keep the embedding table in float (the SmoothQuant authors' setting; "
                        "by default it is int8 per row)")
    z.add_argument("--float-head", action="store_true",
                   help="keep the output head in float (the SmoothQuant authors' setting; by "
                        "default it is per-channel W8 with per-token activations)")
    z.add_argument("--fake", action="store_true",
                   help="fake-quant (quantize-dequantize in float) instead of int8 matmuls")
    z.add_argument("--calib-text", help="UTF-8 calibration text (default: the embedded corpus)")
    z.add_argument("--n-seqs", type=int, default=512, help="calibration sequences")
    z.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    z.add_argument("--out", required=True, help="model directory to write")
    z.add_argument("--format", choices=["orbax", "safetensors"], default="safetensors",
                   help="how the quantized weights are stored")
    z.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    z.add_argument("--json", help="write what was chosen (alpha, search losses) here")
    z.add_argument("--quiet", action="store_true", help="no progress bars")
    z.set_defaults(fn=cmd_quantize)

    ev = sub.add_parser("eval", help="StreamEval, passkey retrieval, attention-sink analysis")
    evs = ev.add_subparsers(dest="task", required=True)
    for name, hlp in (("streameval", "register lines queried 20 lines back (StreamingLLM Fig. 9)"),
                      ("passkey", "a 5-digit key hidden in filler, by length and depth"),
                      ("qa", "question/answer records from a JSONL file in one stream"),
                      ("sinks", "attention maps and the sink metric per layer"),
                      ("outliers", "activation outlier channels before/after smoothing")):
        t = evs.add_parser(name, help=hlp)
        t.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
        t.add_argument("--out", default=f"eval_out/{name}",
                       help="writes OUT.json and OUT.png")
        t.add_argument("--seed", type=int, default=0,
                       help="random seed (task content, sampled sequences)")
        t.add_argument("--quiet", action="store_true", help="no progress output")
        if name == "outliers":
            t.add_argument("--layer", default=None,
                           help="linear layer, e.g. layer_0/attn/q (the default)")
            t.add_argument("--alpha", default=None, help="migration strength (family default)")
            t.add_argument("--n-seqs", type=int, default=16, help="calibration sequences")
            t.add_argument("--seq-len", type=int, default=256,
                           help="tokens per calibration sequence")
        elif name == "sinks":
            t.add_argument("--n", type=int, default=16, help="sequences averaged")
            t.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
            t.add_argument("--eps", type=float, default=0.3, help="sink threshold")
        else:
            t.add_argument("--method", default="streaming",
                           help="cache policy: dense | window | recompute | streaming")
            t.add_argument("--sinks", type=int, default=None,
                           help="sink tokens kept (None: 4 for streaming, 0 otherwise)")
            t.add_argument("--cache", type=int, default=1024, help="cache size = sinks + window")
            t.add_argument("--chunk", type=int, default=256, help="tokens per forward call")
        if name == "streameval":
            t.add_argument("--lines", type=int, default=400, help="register lines in the stream")
            t.add_argument("--bucket", type=int, default=2000,
                           help="report accuracy per this many tokens of input")
        if name == "qa":
            t.add_argument("--data", help="JSONL of {question, answer, choices?} (default: the "
                                          "built-in synthetic sample)")
            t.add_argument("--repeat", type=int, default=50,
                           help="with the sample: how many times to repeat it")
        if name == "passkey":
            t.add_argument("--lengths", default="500,1000,2000", help="stream lengths (tokens)")
            t.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="key depths in [0, 1]")
            t.add_argument("--trials", type=int, default=5, help="keys per length and depth")
        t.set_defaults(fn=cmd_eval)

    e = sub.add_parser("export-hf", help="write a GPT-NeoX/Llama/Mistral model in HF format")
    e.add_argument("--model", required=True, help=MODEL_HELP)
    e.add_argument("--out", required=True, help="directory to write (config.json + safetensors)")
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(fn=cmd_export_hf)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (CliError, ValueError) as e:  # the library raises ValueError for bad input
        print(f"jaxllm {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
