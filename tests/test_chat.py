"""The streaming chat (jaxllm/chat.py): what each round feeds is the chat template's text for the
conversation, and each answer is the greedy continuation a plain causal forward over the whole
conversation gives (no cache), while the rounds share one cache."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import jaxllm
from jaxllm.chat import chat, turn_text
from jaxllm.generate import SamplingConfig
from jaxllm.tokenizer import HFTokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
WORDS = ["<unk>", "<s>", "</s>", "user:", "assistant:", "\n"] + [f"w{i}" for i in range(58)]


@pytest.fixture(scope="module")
def tiny():
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", chat_template=TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<s>", "</s>"]})
    tok = HFTokenizer.of(fast, "tiny")
    cfg = jaxllm.ModelConfig.llama(vocab_size=len(WORDS), hidden_size=32, num_layers=2,
                                   num_heads=4, num_kv_heads=2, intermediate_size=48)
    return cfg, jaxllm.init_params(cfg, jax.random.key(3)), tok


def test_turns_add_up_to_the_template(tiny):
    """Fed turns and generated answers (as they follow the generation prompt: " w3") make the
    template's rendering of the conversation; an answer cut off before its end token is closed
    with one."""
    _, _, tok = tiny
    history, fed, ended = [], "", True
    for q, a, stops in (("w1 w2", "w3", True), ("w4", "w5 w6", False), ("w7", "w8", True)):
        fed += turn_text(tok, history, q, ended)
        msgs = history + [{"role": "user", "content": q}]
        assert fed == tok.chat(msgs)
        fed += " " + a + ("</s>" if stops else "")
        history, ended = msgs + [{"role": "assistant", "content": a}], stops
    closing = turn_text(tok, history, "w9", ended)  # the third answer stopped: "\n" follows
    assert (fed + closing).startswith(tok.tok.apply_chat_template(history, tokenize=False))


@pytest.mark.parametrize("policy", [jaxllm.StreamingLLM(4, 60), jaxllm.H2O(cache=64)],
                         ids=["streaming", "h2o"])
def test_warm_up_compiles_what_a_turn_runs(tiny, policy):
    """Chat.warm_up (at a terminal, while the user types) compiles both programs of a turn in
    the background, over the chat's own cache with nothing to write: the cache is then a
    fresh one's, the first send compiles nothing, and answers as an unwarmed chat."""
    from jaxllm.chat import Chat
    cfg, params, tok = tiny

    def fresh():  # a chunk no other test compiles, so the warm-up has work to do
        return Chat(params, cfg, tok, policy.make_cache(cfg, 1, 64),
                    SamplingConfig(max_new_tokens=5), chunk=5)
    c = fresh()
    c.warm_up()
    c._warming.join()
    assert c.held == 0
    jax.tree.map(np.testing.assert_array_equal, c.cache, fresh().cache)
    compiled = []

    def on(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kw.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        got = [c.send(q).answer for q in ("w1 w2 w3", "w9")]
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
    assert compiled == [], compiled
    u = fresh()
    assert got == [u.send(q).answer for q in ("w1 w2 w3", "w9")]


def _rss_mib() -> float:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what glibc keeps of freed memory is not held
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_chat_holds_one_cache(tiny):
    """The cache given to a Chat is donated to its first turn and not kept beside the live one
    (host views of it, kept for reset(), held its buffers: a second cache's memory all chat
    long); reset() then starts again from an empty cache."""
    from jaxllm.chat import Chat
    _, _, tok = tiny
    cfg = jaxllm.ModelConfig.llama(vocab_size=len(WORDS), hidden_size=256, num_layers=2,
                                   num_heads=2, num_kv_heads=2, intermediate_size=64)
    params = jaxllm.init_params(cfg, jax.random.key(0))
    cache = jaxllm.init_cache(cfg, 1, sinks=4, window=65_532)  # 256 MiB of keys and values
    mib = sum(x.nbytes for x in jax.tree.leaves(cache)) / 2**20
    before = _rss_mib()
    c = Chat(params, cfg, tok, cache, SamplingConfig(max_new_tokens=3), chunk=4)
    del cache
    first = c.send("w1 w2")  # compiles too: the programs' memory is small beside the cache
    assert _rss_mib() - before < mib / 2
    c.reset()
    assert c.held == 0 and _rss_mib() - before < mib / 2
    again = c.send("w1 w2")  # a new conversation: the first turn again
    assert (again.answer, again.held) == (first.answer, first.held)


def test_answers_are_greedy_continuations_of_the_whole_conversation(tiny):
    cfg, params, tok = tiny
    questions = ["w1 w2 w3", "w9", "w10 w11 w12 w13"]
    cache = jaxllm.init_cache(cfg, 1, sinks=0, window=256, ring=False)  # dense: nothing lost
    rounds, cache = chat(params, cfg, tok, questions, cache, SamplingConfig(max_new_tokens=6))
    seq: list[int] = []
    ended = True
    history: list = []
    for r, q in zip(rounds, questions):
        seq += tok.encode(turn_text(tok, history, q, ended))
        want = []
        for _ in range(r.answer_tokens):  # greedy, one plain forward per token
            logits, _ = jaxllm.forward(params, cfg, jnp.asarray([seq + want]))
            want.append(int(np.argmax(np.asarray(logits[0, -1]))))
            if want[-1] == tok.eos_id:
                break
        assert len(want) == r.answer_tokens
        ended = want[-1] == tok.eos_id
        assert r.answer == tok.decode(want[:-1] if ended else want).strip()
        seq += want
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.answer}]
        assert r.seen == len(seq) == r.held  # the cache holds every token fed
    assert rounds[-1].kv_bytes == 2 * 2 * 2 * 256 * 8 * 4  # k, v x layers x heads x slots x dh


def test_a_stop_string_inside_a_burst(tiny):
    """An answer generated a burst at a time stops at a stop string that appears inside a burst:
    the answer is cut before it, and the burst's later tokens are in the cache and counted, so
    the conversation goes on from what the cache holds."""
    from jaxllm.chat import Chat
    cfg, params, tok = tiny

    def chat(stop=()):
        cache = jaxllm.init_cache(cfg, 1, sinks=0, window=256, ring=False)
        return Chat(params, cfg, tok, cache, SamplingConfig(max_new_tokens=12), stop=stop,
                    burst=4)
    free = chat().send("w1 w2 w3")
    words = free.answer.split()
    assert len(words) >= 4, free.answer  # the stop string comes inside the first burst
    stop = words[2]
    c = chat([stop])
    got = c.send("w1 w2 w3")
    assert got.stopped_by == "stop string"
    assert got.answer == free.answer[:free.answer.index(stop)].strip()
    assert got.answer_tokens > len(tok.encode(got.answer))  # the burst's rest, kept
    assert got.seen == got.held == c.held
    after = c.send("w9")
    assert after.seen == after.held == got.held + after.prompt_tokens + after.answer_tokens


def test_a_chat_needs_a_template_and_an_end_token(tiny, capsys):
    from jaxllm.cli import main
    assert main(["generate", "--model", "embedded", "--chat", "--prompt", "hi"]) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    """The tiny chat model as a jaxllm model directory (its tokenizer and template inside)."""
    cfg, params, tok = tiny
    d = str(tmp_path_factory.mktemp("tinychat") / "m")
    jaxllm.save_model(d, cfg, params, tokenizer=tok)
    return d


def _demo(model_dir, out, template=None):
    """A CI-sized `jaxllm demo` on the tiny chat model, in a subprocess (unbuffered: its lines
    arrive as printed)."""
    import subprocess
    import sys
    if template is not None:
        cfg_path = os.path.join(model_dir, "tokenizer", "tokenizer_config.json")
        conf = json.load(open(cfg_path))
        conf["chat_template"] = template
        json.dump(conf, open(cfg_path, "w"))
        for f in ("chat_template.jinja",):
            if os.path.exists(os.path.join(model_dir, "tokenizer", f)):
                open(os.path.join(model_dir, "tokenizer", f), "w").write(template)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "jaxllm.cli", "demo", "--model", f"tiny={model_dir}", "--tokens",
         "200", "--cache", "32", "--sinks", "2", "--positions", "4", "--chat-cache", "40",
         "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _scored(out):
    r = json.load(open(os.path.join(out, "demo.json")))
    assert [row["method"] for row in r["rows"]] == [
        "dense", "window 0+32", "StreamingLLM 2+30", "recompute 2+30, sampled"]
    assert os.path.getsize(os.path.join(out, "demo.png")) > 1000
    return r


def test_a_demo_killed_in_its_chat_keeps_its_results(tiny_dir, tmp_path):
    """SIGKILL as soon as the chat begins: the table was printed, demo.json and demo.png are
    written (the chat, which had not finished, is absent)."""
    import signal
    out = str(tmp_path / "out")
    proc = _demo(tiny_dir, out)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if "a chat through one" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(printed) + proc.stderr.read()
    assert any(line.startswith("tiny ") and "StreamingLLM 2+30" in line for line in printed)
    assert _scored(out)["chat"] == {}


def test_a_demo_whose_chat_fails_keeps_its_results(tiny, tmp_path):
    """A chat template that raises: one line naming the template, exit status 2, and the
    scoring's results written."""
    cfg, params, tok = tiny
    d = str(tmp_path / "m")
    jaxllm.save_model(d, cfg, params, tokenizer=tok)
    out = str(tmp_path / "out")
    proc = _demo(d, out, template="{{ raise_exception('no chats here') }}")
    stdout, stderr = proc.communicate()
    assert proc.returncode == 2, stderr
    assert "no chats here" in stderr and "Traceback" not in stderr
    assert _scored(out)["chat"] == {}


def _generate_rounds(cfg, params, tok, questions, max_new):
    """The conversation by jaxllm.generate (one compiled loop per round, the cache it returns
    carried to the next round): the answers' texts."""
    from jaxllm.generate import generate
    cache = jaxllm.StreamingLLM(4, 64).make_cache(cfg, 1, 64)
    history, ended, fed, answers = [], True, False, []
    sc = SamplingConfig(max_new_tokens=max_new, eos_id=tok.eos_id)
    for q in questions:
        ids = tok.encode(turn_text(tok, history, q, ended, fed))
        res = generate(params, cfg, jnp.asarray([ids]), cache, sc)
        cache, fed = res.cache, True
        out = [int(t) for t in np.asarray(res.tokens[0, :int(res.num_tokens[0])])]
        ended = out[-1] == tok.eos_id
        body = tok.decode(out[:-1] if ended else out).strip()
        answers.append(body)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": body}]
    return answers


QUESTIONS = ["w1 w2 w3", "w9", "w10 w11 w12 w13", "w4 w4"]


@pytest.mark.parametrize("chunk", [None, "3"])  # the default, and every turn in several calls
def test_chat_command_reads_stdin_and_answers_as_generate_does(tiny, tiny_dir, capsys,
                                                                monkeypatch, chunk):
    import io
    from jaxllm.cli import main
    cfg, params, tok = tiny
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(QUESTIONS) + "\n"))
    assert main(["--no-compile-cache", "chat", "--model", tiny_dir, "--max-new-tokens", "6",
                 "--sinks", "4", "--cache", "64"] + (["--chunk", chunk] if chunk else [])) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert [lines[i] for i in range(0, len(lines), 2)] == [f">>> {q}" for q in QUESTIONS]
    want = _generate_rounds(cfg, params, tok, QUESTIONS, 6)
    assert [lines[i].strip() for i in range(1, len(lines), 2)] == want
    assert printed.err.count(" tok/s") == len(QUESTIONS)


def test_a_piped_chat_compiles_its_answer_before_it_reads_the_weights(tiny_dir, monkeypatch,
                                                                       capsys):
    """Questions piped in: the answer's program (generate.steps) compiles from the weights'
    shapes before the weights are read, so its load's transient comes while little else is in
    memory (docs/CPU.md, "Peak memory"), and the answers run it without compiling again."""
    from conftest import piped_chat_order
    # a burst no other test uses: the program is compiled here, not found in memory
    seen = piped_chat_order(monkeypatch, ["--no-compile-cache", "chat", "--model", tiny_dir,
                                          "--max-new-tokens", "6", "--sinks", "4", "--cache",
                                          "64", "--burst", "3"], "w1 w2 w3\nw9\n")
    assert seen[:2] == ["steps", "read"] and seen.count("steps") == 1, seen
    assert capsys.readouterr().err.count(" tok/s") == 2


def test_the_chat_command_keeps_its_cache_in_float16_unless_asked(tiny_dir, monkeypatch):
    """jaxllm chat's default cache is float16 (llama.cpp's: half the bytes); --kv-dtype
    float32 still gives float32."""
    import io

    from jaxllm.chat import Chat
    from jaxllm.cli import main
    seen, send = [], Chat.send
    monkeypatch.setattr(Chat, "send", lambda self, *a, **k: seen.append(self.cache.k[0].dtype)
                        or send(self, *a, **k))
    for extra in ([], ["--kv-dtype", "float32"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2\n"))
        assert main(["chat", "--model", tiny_dir, "--max-new-tokens", "2", "--sinks", "4",
                     "--cache", "64", *extra]) == 0
    assert seen == [jnp.float16, jnp.float32], seen


@pytest.mark.parametrize("weights", ["stored", "bfloat16"])
def test_the_shapes_a_chat_compiles_for_are_those_of_the_load(tiny_dir, weights):
    """cli.common.load's ``shapes_only`` against the load itself (else the early compile would
    be for other shapes, and the answers would compile again)."""
    from jaxllm.cli.common import load
    cfg, params, _ = load(tiny_dir, weights=weights, file_blocks=True)
    cfg_s, shapes, _ = load(tiny_dir, weights=weights, file_blocks=True, shapes_only=True)
    assert cfg_s == cfg and jax.tree.structure(shapes) == jax.tree.structure(params)
    assert [(s.shape, s.dtype) for s in jax.tree.leaves(shapes)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(params)]


def test_leaving_a_terminal_chat_at_once_exits_cleanly(tiny_dir):
    """Ctrl-D at the first prompt, while the programs compile in the background (Chat.warm_up):
    exit status 0, and no abort from tearing the compile down."""
    import pty
    import select
    import subprocess
    import sys
    import time
    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.cli", "--no-compile-cache", "chat",
                             "--model", tiny_dir, "--max-new-tokens", "4", "--chunk", "7"],
                            stdin=sub_fd, stdout=sub_fd, stderr=sub_fd, close_fds=True)
    os.close(sub_fd)
    seen, end = "", time.monotonic() + 120
    while ">>> " not in seen and time.monotonic() < end:
        if select.select([main_fd], [], [], 1.0)[0]:
            seen += os.read(main_fd, 4096).decode(errors="replace")
    os.write(main_fd, b"\x04")
    proc.wait(timeout=120)
    try:
        while select.select([main_fd], [], [], 0.5)[0]:
            seen += os.read(main_fd, 4096).decode(errors="replace")
    except OSError:  # the terminal closed with the process
        pass
    os.close(main_fd)
    assert ">>> " in seen and proc.returncode == 0, seen
    assert "terminate called" not in seen and "Traceback" not in seen, seen


def test_chat_command_at_a_terminal(tiny_dir):
    """Driven through a pseudo-terminal: a prompt, answers streamed, /cache, /reset (the same
    question then gets the same answer as in a fresh conversation), /exit."""
    import pty
    import select
    import subprocess
    import sys
    import time
    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.cli", "chat", "--model", tiny_dir,
                             "--max-new-tokens", "6", "--sinks", "4", "--cache", "64"],
                            stdin=sub_fd, stdout=sub_fd, stderr=sub_fd, close_fds=True)
    os.close(sub_fd)
    seen = [""]

    def until(text, limit=120.0):
        end = time.monotonic() + limit
        while text not in seen[0]:
            assert time.monotonic() < end, f"no {text!r} in {seen[0]!r}"
            if select.select([main_fd], [], [], 1.0)[0]:
                try:
                    seen[0] += os.read(main_fd, 4096).decode(errors="replace")
                except OSError:
                    break
        i = seen[0].index(text) + len(text)
        got, seen[0] = seen[0][:i], seen[0][i:]
        return got

    def say(line):
        os.write(main_fd, (line + "\n").encode())

    until(">>> ")
    say("w1 w2 w3")
    first = until(">>> ")
    say("w9")
    until(">>> ")
    say("/cache")
    assert "the cache holds" in until(">>> ")
    say("/reset")
    assert "a new conversation" in until(">>> ")
    say("w1 w2 w3")
    again = until(">>> ")
    say("/exit")
    proc.wait(timeout=60)
    os.close(main_fd)
    assert proc.returncode == 0
    answer = lambda s: s.split("[")[0].strip().splitlines()[-1]  # noqa: E731
    assert answer(first) == answer(again) and "tok/s" in first
