"""Every numeric flag of every command, parsed in process with any value hypothesis finds
(integers past int64, NaN, infinities, 1e400, words, unicode digits, thousands of digits): the
result is a setting in the flag's declared range or a one-line error naming the flag, never an
exception of another kind. The flags are found by walking the parsers, so a new one is covered
the day it is added, and none may take a plain ``int``/``float`` (jaxllm.argtypes defines each
kind of number once)."""
import argparse

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxllm import cli
from jaxllm.argtypes import integer, listof, real
from train import cli as train_cli
from train.experiments import sink_token


def numeric_flags(parser, prefix=()):
    """(parser, argv before the flag, flag, its type, its dest) for every (sub)command."""
    required = [x for a in parser._actions if a.required and a.option_strings
                for x in (a.option_strings[-1], "x")]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from ((p, list(prefix) + [name] + rest, f, t, d)
                            for p, rest, f, t, d in numeric_flags(sub, ()))
        elif a.option_strings:
            assert a.type not in (int, float), (prefix, a.option_strings, "a plain number type")
            if isinstance(a.type, (integer, real, listof)):
                yield parser, list(prefix) + required, a.option_strings[-1], a.type, a.dest


PARSERS = {"jaxllm": cli.build_parser(), "train": train_cli.build_parser(),
           "sink_token": sink_token.build_parser()}
FLAGS = [(name, rest, flag, t, dest) for name, p in PARSERS.items()
         for _, rest, flag, t, dest in numeric_flags(p)]


def test_every_command_has_its_numbers_typed():
    names = {(n, " ".join(r[:2]), f) for n, r, f, *_ in FLAGS}
    for want in [("jaxllm", "ppl", "--cache"), ("jaxllm", "generate", "--max-new-tokens"),
                 ("jaxllm", "generate", "--temperature"), ("jaxllm", "quantize", "--n-seqs"),
                 ("jaxllm", "eval sinks", "--n"), ("jaxllm", "demo", "--tokens"),
                 ("train", "run", "--steps")]:
        assert any(n == want[0] and r.startswith(want[1]) and f == want[2]
                   for n, r, f in names), want
    assert len(FLAGS) >= 60


ODD = ["nan", "NaN", "inf", "-inf", "1e12", "1e400", "-1e400", "0x10", " 7 ", "+3", "-0", "３",
       "1_000", "1e3", "2147483647", "2147483648", "-2147483649", "9" * 5000, "", " ", "0.5",
       "1.0", "\n", "١٢"]
VALUES = st.one_of(st.sampled_from(ODD), st.integers(-2 ** 70, 2 ** 70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.text(max_size=12))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FLAGS), VALUES)
def test_any_value_is_a_valid_setting_or_one_line(case, value):
    name, rest, flag, kind, dest = case
    argv = rest + [f"{flag}={value}"]
    try:
        ns = PARSERS[name].parse_args(argv)
    except cli.CliError as e:
        msg = str(e)
        assert "\n" not in msg and flag in msg, (argv, msg)
        return
    v = getattr(ns, dest)
    if isinstance(kind, listof):  # a list flag: each value checked as its kind
        (v,), kind = v, kind.kind
    if isinstance(kind, integer):
        assert type(v) is int and kind.lo <= v <= kind.hi, (argv, v)
    else:
        assert type(v) is float and v in kind, (argv, v)


@pytest.mark.parametrize("kind,text,want", [
    (integer(1), "12", 12), (integer(0, 8), "+8", 8), (real(0.0, 1.0), "1", 1.0),
    (real(0.0, 1.0, lo_open=True), "1e-9", 1e-9)])
def test_valid_values_parse_to_themselves(kind, text, want):
    assert kind(text) == want


def test_library_errors_name_their_settings_and_the_cli_its_flags(capsys):
    """A library check names the setting it is about (jaxllm.errors.SettingError.params): the
    API's message says "kv group", the command line's "--kv-group", from one message."""
    from jaxllm.errors import SettingError
    from jaxllm.kv.quantized import KVQuant
    with pytest.raises(SettingError) as e:
        KVQuant("kivi", 2, group=32, residual=48)
    assert e.value.params == ("kv_group", "kv_residual")
    assert str(e.value) == "kv group 32 must divide the kv residual 48 (KIVI flushes R keys " \
                           "as R/G groups)"
    assert cli.main(["ppl", "--model", "embedded", "--kv-quant", "kivi", "--kv-group", "32",
                     "--kv-residual", "48"]) == 2
    assert "--kv-group 32 must divide the --kv-residual 48" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["eval", "passkey", "--lengths", "500,2000000000"], "--lengths: in '500,2000000000': "
                                                         "2000000000 is out of range"),
    (["eval", "passkey", "--depths", "0,1.5"], "--depths: in '0,1.5': 1.5 is out of range"),
    (["eval", "passkey", "--lengths", ",".join(["9"] * 65)], "at most 64 comma-separated"),
    (["eval", "kv-shift", "--bits", "abc"], "--bits: in 'abc': expected an integer"),
    (["eval", "kv-shift", "--bits", "8,5"], "--bits 5: the token format packs 2, 3, 4 or 8"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "2147483647"],
     "max_new_tokens=2147483647 needs 16.0 GiB for the generated tokens"),
    (["ppl", "--int8-inputs"], "--int8-inputs: no 4- or 8-bit weights in groups of a multiple"),
])
def test_list_flags_and_huge_budgets_are_refused_in_one_line(argv, msg, capsys, monkeypatch):
    import sys
    import jaxllm.generate  # noqa: F401  (the module; the package's name is the function)
    # As on any machine with 8 GiB free.
    monkeypatch.setattr(sys.modules["jaxllm.generate"], "available_bytes", lambda: 8 << 30)
    assert cli.main(argv + ["--model", "embedded"]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err, err
