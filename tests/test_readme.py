"""Every code block of the README runs as written, on SmolLM2 (the packaged default model), and
does what the text around it says: the Python API answers questions right, the shell commands
exit 0. `make demo` and `make test` are CI's own two steps (.ci/run), so they are not run here.

SmolLM2 is loaded once for the module (each command would otherwise spend ~15 s loading it)."""
import os
import re
import shlex
import shutil

import pytest

import jaxllm
import jaxllm.io
from jaxllm.cli import main

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", open(README).read(), re.S)
SETUP = ("make ", "pip ", "source ")


@pytest.fixture(scope="module")
def smollm2_once():
    loaded = jaxllm.io.load_model("smollm2")
    real = jaxllm.io.load_model

    def load(spec, *args, **kwargs):
        return loaded if spec == "smollm2" and not args and not kwargs else \
            real(spec, *args, **kwargs)
    mp = pytest.MonkeyPatch()
    mp.setattr(jaxllm.io, "load_model", load)
    mp.setattr(jaxllm, "load_model", load)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def in_tmp(tmp_path_factory):
    """One working directory for the module: a later command reads what an earlier one wrote
    (quantize's --out), and the README's own text is at hand (ppl --text README.md)."""
    d = tmp_path_factory.mktemp("readme")
    shutil.copy(README, d / "README.md")
    here = os.getcwd()
    os.chdir(d)
    yield d
    os.chdir(here)


# Each shell command of the README, in order (the ones that set up the environment left out).
COMMANDS = [line.split("#")[0].strip() for lang, block in BLOCKS if lang == "bash"
            for line in block.splitlines()
            if line.split("#")[0].strip() and not line.strip().startswith(SETUP)]


def test_the_readme_has_its_blocks():
    langs = [lang for lang, _ in BLOCKS]
    assert langs.count("python") == 3 and langs.count("bash") >= 4


@pytest.mark.parametrize("command", COMMANDS)
def test_shell_command(command, smollm2_once, in_tmp, capsys, monkeypatch):
    import io
    stdin = ""
    if "|" in command:  # echo "TEXT" | jaxllm ...: the text is the command's stdin
        head, command = (part.strip() for part in command.split("|", 1))
        stdin = shlex.split(head)[1] + "\n"
    argv = shlex.split(command)
    assert argv[0] == "jaxllm", command
    if argv[1] == "chat" and not stdin:  # at a terminal a person types a question
        stdin = "What is the capital of France?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(argv[1:]) == 0, (command, capsys.readouterr().err[-2000:])
    out = capsys.readouterr().out
    if argv[1] == "chat":
        assert "Paris" in out, out
    if argv[1] == "ppl":
        assert "ppl " in out and "over 255 tokens" in out, out
    if argv[1] == "quantize":
        assert os.path.getsize("smollm2-4bit/model.safetensors") < 1.1 * os.path.getsize(
            jaxllm.io.packaged_path("smollm2"))  # the embedding int8: under the GGUF's bytes


PYTHON = [block for lang, block in BLOCKS if lang == "python"]
NAMESPACE: dict = {}  # the blocks run in order in one namespace, as in one session


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_block(i, smollm2_once, in_tmp, capsys):
    exec(compile(PYTHON[i], "README.md", "exec"), NAMESPACE)
    out = capsys.readouterr().out.splitlines()
    if i == 0:  # the chat: right answers
        assert "Paris" in out[0] and "Rome" in out[1], out
    elif i == 1:  # readable text
        assert len(out[0]) > 10 and all(c.isprintable() for c in out[0]), out
    else:
        assert re.fullmatch(r"StreamingLLM 4\+252: perplexity \d+\.\d\d", out[0]), out
