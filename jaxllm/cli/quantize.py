"""``jaxllm quantize``: SmoothQuant W8A8/W8, or GPTQ / RTN low-bit weights."""
from __future__ import annotations

import os
import sys

import numpy as np

from ..argtypes import COUNT, SIZE, integer, real
from .common import (CliError, DEFAULT_MODEL, MODEL_HELP, OVERWRITE_HELP, alpha_value,
                     check_files, check_out, load, read_text, sources, write_json)


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
                   help="keep the embedding table (and a tied head) in float (the SmoothQuant "
                        "authors' setting; by default it is int8 per row, for every scheme)")
    p.add_argument("--float-head", action="store_true",
                   help="keep the output head in float (the SmoothQuant authors' setting; by "
                        "default it is per-channel W8 with per-token activations)")
    p.add_argument("--fake", action="store_true",
                   help="fake-quant (quantize-dequantize in float) instead of int8 matmuls")
    p.add_argument("--calib-text", help="UTF-8 calibration text, from the domain you will use the model on: "
                        "quantization learns the text it calibrates on (default: an embedded "
                        "mix of English prose and Python's documentation; recorded in the "
                        "model's config.json)")
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
                     "int8_attention", "float_head", "fake")
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


def calibration_text(a) -> tuple[str, dict]:
    """The calibration text and what to record of it (name, sha256, characters)."""
    import hashlib

    from ..corpus import CALIBRATION, calibration_corpus
    text = read_text(a.calib_text) if a.calib_text else calibration_corpus()
    return text, {"text": os.path.abspath(a.calib_text) if a.calib_text else CALIBRATION,
                  "sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text)}


def _say_calibration(a, record: dict) -> None:
    print(f"calibrated on {record['text']}: {record['seqs']} x {record['seq_len']} tokens"
          + ("" if a.calib_text else "; quantization learns the calibration text's domain, so "
             "for your own use pass text like it with --calib-text FILE"), file=sys.stderr)


def cmd_quantize_lowbit(a, cfg, params, tok) -> None:
    from .. import gptq
    from ..io import save_model
    from ..smoothquant import CalibConfig, calibration_windows
    from ..tokenizer import ByteTokenizer
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
    provenance = {"command": "quantize", "scheme": a.scheme, "from": a.model}
    if a.scheme == "gptq":
        text, record = calibration_text(a)
        ids = np.asarray(tok.encode(text))
        try:
            calib, _ = calibration_windows(
                ids, CalibConfig(n_seqs=n_seqs, seq_len=a.seq_len), False)
        except ValueError as e:
            raise CliError(str(e)) from None
        provenance["calibration"] = dict(record, seqs=len(calib), seq_len=a.seq_len)
        _say_calibration(a, provenance["calibration"])
    try:
        q, info = gptq.quantize_model(params, cfg, calib, qcfg, progress=not a.quiet,
                                      int8_embedding=not a.float_embedding)
        save_model(a.out, cfg, q, "byte" if isinstance(tok, ByteTokenizer) else tok,
                   format=a.format, overwrite=a.overwrite, sources=sources(a.model),
                   provenance=provenance)
    except ValueError as e:
        raise CliError(str(e)) from None
    mib = lambda n: n / 2 ** 20  # noqa: E731
    print(f"quantized {a.model} with {a.scheme}, {qcfg.bits}-bit, "
          f"{'per channel' if not qcfg.group else f'groups of {qcfg.group}'}"
          f"{', act-order' if qcfg.act_order else ''}: linears {mib(info['linear_bytes']):.1f} "
          f"MiB (float32 {mib(info['float_linear_bytes']):.1f}), embedding "
          f"{'as loaded' if a.float_embedding else 'int8 per row'}, head and norms "
          f"{mib(info['other_bytes']):.1f} MiB -> {a.out}")
    if a.json:
        write_json(a.json, dict(info, model=a.model, calib_seqs=len(calib), seq_len=a.seq_len,
                                calibration=provenance.get("calibration")), a.json_sources)


def cmd_quantize(a) -> None:
    from ..io import save_model
    from ..smoothquant import CalibConfig, paper_alpha, quantize
    from ..tokenizer import ByteTokenizer
    _refuse_other_kind(a)
    check_out(a, sources(a.model))
    # --json must not land in the model read, the calibration text, or the --out written
    a.json_sources = sources(a.model) + [p for p in (a.calib_text, a.out) if p]
    check_files({"--json": a.json}, a.json_sources)
    cfg, params, tok = load(a.model)
    if a.scheme in ("gptq", "rtn"):
        return cmd_quantize_lowbit(a, cfg, params, tok)
    alpha = a.alpha if a.alpha in (None, "auto") else alpha_value(a.alpha, "--alpha")
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
    text, record = calibration_text(a)
    ids = tok.encode(text)
    try:
        q, info = quantize(params, cfg, ids, a.scheme, alpha, smooth=not a.no_smooth,
                           smooth_down=a.smooth_down, real=not a.fake,
                           int8_attention=a.int8_attention,
                           per_channel=True if a.per_channel_weights else None,
                           quantize_embedding=not a.float_embedding,
                           quantize_head=not a.float_head,
                           calib=CalibConfig(n_seqs=n_seqs, seq_len=a.seq_len),
                           progress=not a.quiet, return_info=True)
        provenance = {"command": "quantize", "scheme": a.scheme, "from": a.model,
                      "calibration": dict(record, seqs=n_seqs, seq_len=a.seq_len)}
        save_model(a.out, cfg, q, "byte" if isinstance(tok, ByteTokenizer) else tok,
                   format=a.format, overwrite=a.overwrite, sources=sources(a.model),
                   provenance=provenance)
    except ValueError as e:
        raise CliError(str(e)) from None
    _say_calibration(a, provenance["calibration"])
    if "losses" in info:
        print("alpha search (held-out loss): " + ", ".join(
            f"{k}: {v:.4f}" for k, v in info["losses"].items()))
    print(f"quantized {a.model} with {a.scheme}"
          + (f", alpha {info['alpha']}" if info["smooth"] else ", no smoothing")
          + f" ({'real int8' if not a.fake else 'fake-quant'}) -> {a.out}")
    if a.json:
        write_json(a.json, dict(info, model=a.model, calibration=provenance["calibration"]),
                   a.json_sources)
