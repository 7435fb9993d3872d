"""Streaming perplexity against the naive references, and the CLI's outputs and errors."""
import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import NEOX
from naive import NaiveStream, rounded_weights

import jaxllm
from jaxllm.cli import main
from jaxllm.corpus import builtin_corpus
from jaxllm.policy import KVStorage, Recompute, StreamingLLM, policy_of
from jaxllm.ppl import stream_nll

PARAMS = jaxllm.init_params(NEOX, jax.random.key(0))
TOKENS = np.asarray(jax.random.randint(jax.random.key(9), (70,), 0, NEOX.vocab_size))


def naive_nll(params, cfg, tokens, sinks, window):
    logits = NaiveStream(params, cfg, sinks, window).run(tokens[:-1])
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return -logp[np.arange(len(tokens) - 1), tokens[1:]]


@pytest.mark.parametrize("method,sinks,window", [("streaming", 2, 6), ("window", 0, 8),
                                                 ("dense", 0, None)])
def test_cached_methods_match_naive_stream(method, sinks, window):
    pc = policy_of(method, sinks=sinks or None, cache=None if method == "dense" else 8)
    got = stream_nll(PARAMS, NEOX, TOKENS, pc, chunk=5)
    np.testing.assert_allclose(got, naive_nll(PARAMS, NEOX, TOKENS, sinks, window), atol=5e-5)


def test_recompute_is_forward_on_sinks_plus_last_window():
    S, L = 2, 8
    got = stream_nll(PARAMS, NEOX, TOKENS, Recompute(sinks=S, cache=L))
    for t in [0, 5, L - 1, L, 33, 68]:  # early tokens see everything; later ones S + last L-S
        ctx = TOKENS[:t + 1] if t < L else np.r_[TOKENS[:S], TOKENS[t - (L - S) + 1:t + 1]]
        logits, _ = jaxllm.forward(PARAMS, NEOX, ctx[None])
        ref = -jax.nn.log_softmax(logits[0, -1])[TOKENS[t + 1]]
        np.testing.assert_allclose(got[t], ref, atol=1e-5)


def test_recompute_equals_streaming_for_one_layer():
    # One layer: cached keys depend on the token alone, so re-computation changes nothing.
    cfg = dataclasses.replace(NEOX, num_layers=1)
    params = jaxllm.init_params(cfg, jax.random.key(3))
    a = stream_nll(params, cfg, TOKENS, Recompute(sinks=3, cache=9))
    b = stream_nll(params, cfg, TOKENS, StreamingLLM(sinks=3, cache=9), chunk=7)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_ppl_config_errors():
    with pytest.raises(ValueError, match="unknown method 'sliding'"):
        policy_of("sliding")
    with pytest.raises(ValueError, match="keeps no sink tokens"):
        policy_of("window", sinks=4)
    with pytest.raises(ValueError, match="must exceed sinks"):
        StreamingLLM(sinks=4, cache=4)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        stream_nll(PARAMS, NEOX, TOKENS, chunk=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        stream_nll(PARAMS, NEOX, [3])


def test_builtin_corpus_is_python_docs():
    text = builtin_corpus()
    assert len(text.encode()) > 500_000  # > 100K byte tokens with room to spare
    assert "The \"for\" statement" in text or "for_stmt" in text or "for statement" in text
    assert "Return the absolute value" in text  # builtins.abs docstring


def test_cli_ppl_writes_json_and_plot(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    out = tmp_path / "r"
    rc = main(["ppl", "--model", "random:pythia-tiny", "--text", str(f), "--method", "streaming",
               "--sinks", "4", "--cache", "64", "--max-tokens", "600", "--json",
               str(out / "s.json"), "--plot", str(out / "s.png"), "--quiet"])
    assert rc == 0
    s = json.loads((out / "s.json").read_text())
    assert s["method"] == "streaming" and s["sinks"] == 4 and s["tokens_scored"] == 599
    assert len(s["ppl_per_bucket"]) == 1 and s["nan_count"] == 0 and s["peak_rss_mb"] > 0
    # the summary's ppl is exp(mean NLL) of the same stream scored through the API
    cfg, params, tok = jaxllm.load_model("random:pythia-tiny")
    nll = stream_nll(params, cfg, tok.encode(f.read_text())[:600], StreamingLLM(sinks=4, cache=64))
    assert s["ppl"] == pytest.approx(float(np.exp(nll.astype(np.float64).mean())), rel=1e-5)
    assert (out / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_kv_dtype(tmp_path):
    """``--kv-dtype bfloat16`` scores through a bfloat16 cache (its bits on CPU): the API's
    number for that policy, within bfloat16 rounding of the float32 cache's but not equal to
    it; the summary and label name it, and a bad dtype is refused by name."""
    args = ["ppl", "--model", "random:pythia-tiny", "--cache", "24", "--chunk", "8",
            "--max-tokens", "120", "--quiet"]
    ppl = {}
    for dt in ("float32", "bfloat16"):
        assert main(args + ["--kv-dtype", dt, "--json", str(tmp_path / f"{dt}.json")]) == 0
        ppl[dt] = json.loads((tmp_path / f"{dt}.json").read_text())
    assert ppl["bfloat16"]["kv_dtype"] == "bfloat16" and "KV bfloat16" in ppl["bfloat16"]["label"]
    cfg, params, tok = jaxllm.load_model("random:pythia-tiny")
    ids = tok.encode(builtin_corpus())[:120]
    nll = stream_nll(params, cfg, ids, StreamingLLM(4, 24, KVStorage("bfloat16")), chunk=8)
    assert ppl["bfloat16"]["ppl"] == pytest.approx(float(np.exp(nll.astype(np.float64).mean())),
                                                   rel=1e-5)
    assert ppl["bfloat16"]["ppl"] != ppl["float32"]["ppl"]
    assert ppl["bfloat16"]["ppl"] == pytest.approx(ppl["float32"]["ppl"], rel=1e-2)
    with pytest.raises(ValueError, match="kv dtype must be one of float32, bfloat16, float16"):
        KVStorage("int8")


@pytest.mark.parametrize("content,args,msg", [
    (b"caf\xe9 au lait", [], "is not UTF-8"),
    (b"  \n", [], "is empty"),
    (b"hello world", ["--method", "sliding"], "unknown --method 'sliding'"),
])
def test_cli_bad_input(tmp_path, capsys, content, args, msg):
    f = tmp_path / "t.txt"
    f.write_bytes(content)
    assert main(["ppl", "--model", "embedded", "--text", str(f), "--quiet", *args]) == 2
    assert msg in capsys.readouterr().err


def test_a_flag_the_method_does_not_take_is_named_and_ignored(tmp_path, capsys):
    """One command line serves every method: --sinks and --heavy on a window cache, --cache on a
    dense one, --kv-quant where no cache is kept, each named on stderr and ignored (the
    perplexity is the one without them)."""
    base = ["ppl", "--model", "random:pythia-tiny", "--max-tokens", "60", "--quiet"]
    got = {}
    for name, extra in (("window", ["--method", "window", "--cache", "16"]),
                        ("window+", ["--method", "window", "--cache", "16", "--sinks", "4",
                                     "--heavy", "8"]),
                        ("dense", ["--method", "dense"]),
                        ("dense+", ["--method", "dense", "--cache", "16", "--kv-dtype",
                                    "float32"]),
                        ("recompute", ["--method", "recompute", "--cache", "16"]),
                        ("recompute+", ["--method", "recompute", "--cache", "16",
                                        "--kv-quant", "int8"])):
        path = tmp_path / f"{name}.json"
        assert main(base + extra + ["--json", str(path)]) == 0
        got[name] = json.loads(path.read_text())["ppl"]
        got[name + " err"] = capsys.readouterr().err
    assert got["window+"] == got["window"] and got["dense+"] == got["dense"]
    assert got["recompute+"] == got["recompute"]
    notes = [ln for ln in got["window+ err"].splitlines() if ln.startswith("note: --")]
    assert notes == ["note: --method window keeps no sink tokens (got --sinks 4); use --method "
                     "streaming or recompute or h2o or qhitter for sinks; ignored",
                     "note: --heavy applies to --method h2o or qhitter, not window; ignored"]
    assert "note: --cache applies to" in got["dense+ err"] and "ignored" in got["dense+ err"]
    assert ("note: --method recompute keeps no KV cache between predictions, so --kv-quant and "
            "--kv-dtype do not apply; ignored") in got["recompute+ err"]


def test_cli_generate_rounds(capsys):
    """Each round prints its prompt and continuation as one text (no break between them), the
    continuation being what the API generates for the same rounds."""
    assert main(["generate", "--model", "embedded", "--prompt", "Hello", "--prompt", "again",
                 "--max-new-tokens", "5",
                 "--cache", "16", "--sinks", "2"]) == 0
    out = capsys.readouterr().out
    cfg, params, tok = jaxllm.load_model("embedded")
    cache = jaxllm.init_cache(cfg, 1, sinks=2, window=14)
    want, key = [], jax.random.key(0)
    for prompt in ("Hello", "again"):
        key, sub = jax.random.split(key)
        res = jaxllm.generate(params, cfg, np.asarray([tok.encode(prompt)]), cache,
                              jaxllm.SamplingConfig(max_new_tokens=5, eos_id=tok.eos_id), sub)
        cache = res.cache
        want.append(prompt + tok.decode(list(res.tokens[0, :int(res.num_tokens[0])])))
    assert out == want[0] + "\n\n" + want[1] + "\n"


def test_hf_tokenizer_from_local_directory(tmp_path):
    # A real Hugging Face tokenizer built here (no download), saved and loaded back by path.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<eos>", "the", "cache", "keeps", "sinks"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(tmp_path)
    tok = jaxllm.load_tokenizer(str(tmp_path))
    assert tok.encode("the cache keeps sinks") == [2, 3, 4, 5]
    assert tok.eos_id == 1 and tok.decode([2, 5]) == "the sinks"
    with pytest.raises(ValueError, match="unknown tokenizer"):
        jaxllm.load_tokenizer(str(tmp_path / "missing"))


def _parsers(parser):
    """A parser and every subcommand parser under it."""
    import argparse
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_and_its_default():
    import argparse

    from jaxllm.cli import build_parser
    from train.cli import build_parser as train_parser
    from train.experiments.sink_token import build_parser as experiment_parser
    for root in (build_parser(), train_parser(), experiment_parser()):
        for parser in _parsers(root):
            text = parser.format_help()
            assert "``" not in text, parser.prog  # plain text, no reStructuredText
            for action in parser._actions:
                if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                       argparse._SubParsersAction)) or \
                        action.help == argparse.SUPPRESS:
                    continue
                assert action.help, f"{parser.prog} {action.option_strings} has no help"
                if action.option_strings and action.default not in (None, False, []) and \
                        not action.required:
                    assert f"(default: {action.default})" in " ".join(text.split()), \
                        f"{parser.prog} {action.option_strings[0]} does not show its default"


def test_cli_decode_weights(tmp_path, capsys):
    """``--weights bfloat16`` scores as the float model whose weights were rounded to bfloat16,
    and ``--weights float32`` ([out, in]) as the stored model (the plain float path, an
    independent reference); a quantized model is refused."""
    from jaxllm import quant
    cfg, params, tok = jaxllm.load_model("embedded")
    ids = np.asarray(tok.encode(builtin_corpus())[:120])
    for dtype, rtol in (("bfloat16", 5e-6), ("float32", 1e-6)):  # bfloat16 vs float: 4e-5 off
        assert main(["ppl", "--model", "embedded", "--weights", dtype, "--max-tokens", "120",
                     "--cache", "32",
                     "--chunk", "16", "--quiet", "--json", str(tmp_path / "s.json")]) == 0
        got = json.loads((tmp_path / "s.json").read_text())["ppl"]
        nll = stream_nll(rounded_weights(params, dtype), cfg, ids,
                         StreamingLLM(sinks=4, cache=32), chunk=16)
        np.testing.assert_allclose(got, float(np.exp(np.mean(nll))), rtol=rtol)
    capsys.readouterr()
    assert main(["ppl", "--model", "embedded", "--weights", "int8"]) == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    q = quant.half_weights(params)
    jaxllm.save_model(str(tmp_path / "h"), cfg, q)
    assert main(["ppl", "--model", str(tmp_path / "h"), "--weights", "float16", "--quiet"]) == 2
    assert "--weights float16: these weights are quantized" in capsys.readouterr().err


def test_misspelt_flags_and_commands_get_a_suggestion(capsys):
    """No abbreviations (--max-token is not --max-tokens), a "did you mean" for a misspelt flag
    or command, and --version."""
    assert main(["ppl", "--max-token", "5"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-token" in err and "did you mean --max-tokens" in err
    assert main(["gnerate"]) == 2
    assert "did you mean generate?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("jaxllm ")
