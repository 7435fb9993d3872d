"""Nothing lost, nothing silent (jaxllm.outputs): every output a command writes is checked
before any work, written beside its target and renamed, and never replaces what jaxllm did
not write. Each test records the digests of every file it did not create before and after,
and checks the exit status and the one-line message."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import jax

import jaxllm
from jaxllm import outputs
from jaxllm.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def digests(root) -> dict:
    """Relative path -> sha256 of every file under ``root`` (a file: just that one)."""
    root = str(root)
    if os.path.isfile(root):
        return {root: hashlib.sha256(open(root, "rb").read()).hexdigest()}
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def refused(args, capsys, want: str) -> None:
    """The command exits 2 with one line on stderr that says ``want``."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("m") / "model")
    cfg = jaxllm.PRESETS["pythia-tiny"]
    jaxllm.save_model(d, cfg, jaxllm.init_params(cfg, jax.random.key(0)))
    return d


def test_output_that_is_the_input_text_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, the only copy\n" * 20)
    before = digests(tmp_path)
    refused(["ppl", "--model", "embedded", "--text", str(notes), "--json", str(notes)], capsys,
            f"the output {notes} is the input {notes}")
    assert digests(tmp_path) == before


def test_json_into_the_model_read_is_refused(model_dir, tmp_path, capsys):
    before = digests(model_dir)
    refused(["quantize", "--model", model_dir, "--json", os.path.join(model_dir, "config.json"),
             "--out", str(tmp_path / "q")], capsys, "overlaps the input")
    assert digests(model_dir) == before and not os.path.exists(tmp_path / "q")


def test_json_inside_the_out_written_is_refused(model_dir, tmp_path, capsys):
    refused(["quantize", "--model", model_dir, "--json", str(tmp_path / "q" / "info.json"),
             "--out", str(tmp_path / "q")], capsys, "overlaps the input")


def test_json_and_plot_naming_one_file_are_refused(tmp_path, capsys):
    refused(["ppl", "--model", "embedded", "--json", str(tmp_path / "x"), "--plot",
             str(tmp_path / "x")], capsys, "--json and --plot name the same file")


def test_a_file_jaxllm_did_not_write_is_not_replaced(tmp_path, capsys):
    theirs = tmp_path / "result.json"
    theirs.write_text('{"theirs": true}')
    before = digests(tmp_path)
    refused(["ppl", "--model", "embedded", "--json", str(theirs)], capsys,
            "exists and was not written by jaxllm")
    assert digests(tmp_path) == before


def test_our_own_file_is_replaced_but_not_once_edited(tmp_path):
    path = str(tmp_path / "r.json")
    outputs.write_json(path, {"run": 1})
    outputs.write_json(path, {"run": 2})  # ours, unchanged since: a rerun replaces it
    assert json.load(open(path)) == {"run": 2}
    with open(path, "a") as f:
        f.write("\n")  # the user edited it: theirs now
    before = digests(tmp_path)
    with pytest.raises(outputs.OutputError, match="was not written by jaxllm"):
        outputs.write_json(path, {"run": 3})
    assert digests(tmp_path) == before


def test_an_output_naming_a_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    refused(["ppl", "--model", "embedded", "--json", str(tmp_path / "d")], capsys,
            "is a directory; give a file path")


def test_a_file_that_appears_while_writing_is_kept(tmp_path):
    path = str(tmp_path / "out.json")
    with pytest.raises(outputs.OutputError, match="appeared while jaxllm wrote it"):
        with outputs.atomic_file(path) as tmp:
            with open(tmp, "w") as f:
                f.write("ours")
            with open(path, "w") as f:
                f.write("someone else's")
    assert open(path).read() == "someone else's"
    kept = [p for p in os.listdir(tmp_path) if p.startswith("out.json.jaxllm-new-")]
    assert len(kept) == 1 and open(tmp_path / kept[0]).read() == "ours"


def test_files_that_appear_in_a_model_out_while_saving_are_kept(tmp_path):
    """quantize --out and every model writer: the finished directory is not renamed over a
    target that gained someone else's files; it is kept beside it and named."""
    out = str(tmp_path / "q")
    cfg = jaxllm.PRESETS["pythia-tiny"]
    params = jaxllm.init_params(cfg, jax.random.key(0))
    with pytest.raises(outputs.OutputError, match="changed while jaxllm wrote it"):
        with jaxllm.io.atomic_dir(out) as tmp:
            jaxllm.io._save_safetensors(tmp, {"w": np.zeros(3, np.float32)}, 0)
            os.makedirs(out)
            with open(os.path.join(out, "notes.txt"), "w") as f:
                f.write("the user's")
    assert os.listdir(out) == ["notes.txt"]
    assert any(p.startswith("q.jaxllm-new-") for p in os.listdir(tmp_path))
    jaxllm.save_model(str(tmp_path / "m"), cfg, params)
    (tmp_path / "m" / "notes.txt").write_text("added to a model directory")
    before = digests(tmp_path / "m")
    with pytest.raises(ValueError, match=r"files that are not its \(notes.txt\)"):
        jaxllm.save_model(str(tmp_path / "m"), cfg, params, overwrite=True)
    assert digests(tmp_path / "m") == before


def _drop_root(cmd: list) -> list:
    """``cmd`` without the capabilities that let root ignore file permissions (so a read-only
    or unreadable file means what it means for any user)."""
    if os.geteuid() != 0:
        return cmd
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: file permissions cannot be enforced")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"] + cmd


def test_write_failures_are_one_line(tmp_path):
    """--json, --plot and eval's --out in a read-only directory, as a user: one line each."""
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    try:
        for args in (["ppl", "--model", "embedded", "--json", str(ro / "x.json")],
                     ["ppl", "--model", "embedded", "--plot", str(ro / "sub" / "x.png")],
                     ["eval", "sinks", "--model", "embedded", "--out", str(ro / "e")]):
            p = subprocess.run(_drop_root([sys.executable, "-m", "jaxllm.cli"] + args), cwd=ROOT,
                               env=env, capture_output=True, text=True)
            err = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(err) == 1, (args, p.stderr[-2000:])
            assert str(ro) in err[0] and ("not writable" in err[0]
                                          or "Permission denied" in err[0]), err
        assert os.listdir(ro) == []
    finally:
        os.chmod(ro, 0o755)


def _copy_model(model_dir, tmp_path, name="m"):
    dest = tmp_path / name
    shutil.copytree(model_dir, dest)
    return dest


@pytest.mark.parametrize("change,want", [
    (lambda m, out: (os.rename(m / "model.safetensors", out / "w.safetensors"),
                     os.symlink(out / "w.safetensors", m / "model.safetensors")),
     "model.safetensors leads outside the model directory"),
    (lambda m, out: _edit_config(m, tokenizer=str(out)), "field 'tokenizer' leads outside"),
    (lambda m, out: _edit_config(m, tokenizer=["x"]), "field 'tokenizer' is ['x']"),
    (lambda m, out: _edit_config(m, vocab_size=10 ** 12),
     "config.json: vocab_size must be an integer in [1, 2147483647], got 1000000000000"),
    (lambda m, out: _edit_config(m, norm_eps=1e999), "norm_eps must be a finite number > 0"),
    (lambda m, out: _edit_config(m, format="pickle"), "field 'format' is 'pickle'"),
])
def test_untrusted_model_directories_are_one_line(change, want, model_dir, tmp_path, capsys):
    """Readers open nothing outside the model directory (symlinks resolved), and a malformed
    config names the file and the field."""
    out = tmp_path / "elsewhere"
    out.mkdir()
    m = _copy_model(model_dir, tmp_path)
    change(m, out)
    before = digests(tmp_path)
    refused(["ppl", "--model", str(m), "--quiet"], capsys, want)
    assert digests(tmp_path) == before


def _edit_config(m, **kw):
    meta = json.load(open(m / "config.json"))
    for k, v in kw.items():
        (meta if k in ("tokenizer", "format") else meta["model"])[k] = v
    (m / "config.json").write_text(json.dumps(meta).replace("Infinity", "1e999"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Llama Hugging Face directory with a tokenizer that has a chat template (saved by
    transformers, which writes it as chat_template.jinja)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from convert.hf import to_hf
    d = tmp_path_factory.mktemp("hf") / "llama"
    cfg = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, intermediate_size=48)
    to_hf(cfg, jaxllm.init_params(cfg, jax.random.key(0)), str(d))
    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", eos_token="w1",
                            chat_template="{% for m in messages %}{{ m.content }} w1 "
                                          "{% endfor %}").save_pretrained(str(d))
    assert os.path.exists(d / "chat_template.jinja")
    return d


def _outside(d, name, elsewhere):
    """``d/name`` moved to ``elsewhere`` and replaced by a symlink to it."""
    os.rename(d / name, elsewhere / name)
    os.symlink(elsewhere / name, d / name)


@pytest.mark.parametrize("name,command", [
    ("model.safetensors", "ppl"), ("config.json", "ppl"), ("tokenizer.json", "convert"),
    ("chat_template.jinja", "convert")])
def test_nothing_from_outside_a_hugging_face_directory_is_read_or_copied(
        hf_dir, tmp_path, capsys, name, command):
    """A weights, config or tokenizer file that is a symlink to a file elsewhere is refused in
    one line: it would be read as the model's, or copied into a directory a user publishes."""
    m, elsewhere = tmp_path / "m", tmp_path / "elsewhere"
    shutil.copytree(hf_dir, m)
    elsewhere.mkdir()
    _outside(m, name, elsewhere)
    before = digests(tmp_path)
    args = (["ppl", "--model", str(m), "--quiet", "--max-tokens", "8"] if command == "ppl" else
            ["convert", "--hf", str(m), "--out", str(tmp_path / "out"), "--quiet"])
    refused(args, capsys, f"{name} leads outside the model directory")
    assert digests(tmp_path) == before and not os.path.exists(tmp_path / "out")


def test_the_chat_template_survives_convert_and_export(hf_dir, tmp_path, capsys):
    """convert keeps the chat template (transformers 5 saves it as chat_template.jinja), and
    export-hf writes it back; a symlink in a jaxllm model's tokenizer/ is not copied out."""
    from jaxllm.tokenizer import HFTokenizer
    msgs = [{"role": "user", "content": "w5 w6"}]
    want = HFTokenizer(str(hf_dir)).chat(msgs)
    assert main(["convert", "--hf", str(hf_dir), "--out", str(tmp_path / "j"), "--quiet"]) == 0
    _, _, tok = jaxllm.load_model(str(tmp_path / "j"))
    assert tok.chat(msgs) == want
    assert main(["export-hf", "--model", str(tmp_path / "j"), "--out", str(tmp_path / "h"),
                 "--quiet"]) == 0
    assert HFTokenizer(str(tmp_path / "h")).chat(msgs) == want
    capsys.readouterr()
    (tmp_path / "elsewhere").mkdir()
    _outside(tmp_path / "j" / "tokenizer", "tokenizer.json", tmp_path / "elsewhere")
    refused(["export-hf", "--model", str(tmp_path / "j"), "--out", str(tmp_path / "h2"),
             "--quiet"], capsys, "tokenizer.json leads outside the model directory")
    assert not os.path.exists(tmp_path / "h2")


def _tiny_save(path, seed=0, overwrite=False):
    cfg = jaxllm.PRESETS["pythia-tiny"]
    jaxllm.save_model(str(path), cfg, jaxllm.init_params(cfg, jax.random.key(seed)),
                      overwrite=overwrite)


def test_a_replacement_killed_between_its_renames_gives_the_previous_model_back(tmp_path):
    """A writer SIGKILLed after moving the old model aside and before moving the new one in: the
    next write in that directory puts the previous model back (it used to delete both)."""
    path = tmp_path / "model"
    _tiny_save(path)
    before = digests(path)
    code = ("import os, jax, jaxllm\n"
            "real = os.rename\n"
            "def rename(a, b):\n"
            "    real(a, b)\n"
            "    if '-old-' in b:\n"
            "        os.kill(os.getpid(), 9)\n"
            "os.rename = rename\n"
            "cfg = jaxllm.PRESETS['pythia-tiny']\n"
            f"jaxllm.save_model({str(path)!r}, cfg, jaxllm.init_params(cfg, jax.random.key(1)),"
            " overwrite=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    assert not path.exists()  # killed between the renames
    _tiny_save(tmp_path / "other")  # any write in the same directory repairs it
    assert digests(path) == before
    assert sorted(os.listdir(tmp_path)) == ["model", "other"]


def test_a_temporary_whose_writer_holds_its_lock_is_kept(tmp_path):
    """Another writer's temporary directory (its pid unknown here: another PID namespace) is
    kept while its lock is held, whatever its pid says; removed once the lock is free."""
    import fcntl
    stale_pid = 4194305  # 2^22 + 1: no process on this machine
    work = tmp_path / f".m.jaxllm-partial-{stale_pid}-abc"
    work.mkdir()
    (work / "model.safetensors").write_bytes(b"\1" * 100)
    lock = os.open(str(work) + outputs.LOCK, os.O_CREAT | os.O_RDWR)
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(work) + outputs.LOCK!r}, os.O_RDWR)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True)\n"
                               "sys.stdin.read()\n"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        _tiny_save(tmp_path / "a")
        assert (work / "model.safetensors").read_bytes() == b"\1" * 100
    finally:
        holder.communicate(b"")
    fcntl.flock(lock, fcntl.LOCK_UN)
    os.close(lock)
    _tiny_save(tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_outputs_get_the_umasks_permissions(tmp_path, capsys):
    """A model directory and a --json file are as readable as the umask makes new files (they
    were 0700 / 0600, from their temporaries)."""
    import stat
    old = os.umask(0o022)
    try:
        _tiny_save(tmp_path / "m")
        assert main(["ppl", "--model", "random:pythia-tiny", "--max-tokens", "8", "--quiet",
                     "--json", str(tmp_path / "r.json")]) == 0
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "m") == 0o755 and mode(tmp_path / "r.json") == 0o644
    assert all(mode(tmp_path / "m" / f) & 0o044 == 0o044 for f in os.listdir(tmp_path / "m")
               if os.path.isfile(tmp_path / "m" / f))


def test_a_full_disk_under_safetensors_is_one_line(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error type (a traceback from quantize and
    convert before): now the OSError it is, one line naming the output, nothing left behind."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError('Error while serializing: I/O error: No space left on device '
                              '(os error 28): IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    cfg, params, _ = jaxllm.load_model("embedded")
    out = tmp_path / "m"
    with pytest.raises(ValueError) as e:
        jaxllm.save_model(str(out), cfg, params)
    assert str(e.value) == f"cannot write {out}: No space left on device"
    assert os.listdir(tmp_path) == []
