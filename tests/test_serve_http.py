"""``jaxllm serve`` as a client meets it: a real server in a subprocess on 127.0.0.1 serving
SmolLM2 (the packaged model), spoken to with the official ``openai`` client and with raw HTTP.
Answers streamed and not, chat and completions; greedy answers of concurrent clients equal the
same requests sent one at a time; a session's second turn feeds only its new turn; bad
requests get OpenAI-style errors; a client that disconnects frees its row; a full queue says
429 with Retry-After; the API key is required."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

KEY = "test-key"
MODEL = "smollm2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", "--model", MODEL, "--slots", "2",
           "--sinks", "4", "--cache", "260", "--port", str(port), "--api-key", KEY,
           "--max-queue", "2", "--max-tokens", "48", "--max-prompt", "512"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, JAX_PLATFORMS="cpu"))
    base = f"http://127.0.0.1:{port}"
    while True:  # until it answers (or dies: its log says why)
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    yield base
    proc.terminate()
    proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def post(base, path, body, key=KEY, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


QUESTIONS = ["What is the capital of France?", "Name three colours.",
             "Write one sentence about the sea."]


def ask(client, q, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                          temperature=0, max_tokens=24, **kw)


def test_chat_and_completions_streamed_and_not(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = ask(client, QUESTIONS[0])
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    parts = list(ask(client, QUESTIONS[0], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer streamed
    assert parts[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    s = "".join(p.choices[0].text for p in client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=8, temperature=0, stream=True))
    assert c.choices[0].text == s and c.usage.completion_tokens <= 8


def test_concurrent_clients_get_the_answers_they_get_alone(client):
    alone = [ask(client, q).choices[0].message.content for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda q: ask(client, q).choices[0].message.content, QUESTIONS))
    assert together == alone


def test_a_session_feeds_only_its_new_turn(client):
    msgs = [{"role": "user", "content": "My name is Ada. Say hello."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=16, extra_body={"session_id": "ada"})
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "What is my name?"}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                            max_tokens=16, extra_body={"session_id": "ada"})
    meta = second.model_extra["session"]
    assert meta["id"] == "ada" and not meta["reencoded"]
    assert second.usage.prompt_tokens < 20 < first.usage.prompt_tokens  # the new turn only
    # The same conversation without the session: fed whole, the same answer.
    whole = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=16)
    assert whole.choices[0].message.content == second.choices[0].message.content
    # A history the session does not hold: fed again from the start, and said so.
    edited = msgs[:1] + [{"role": "assistant", "content": "Hi."}] + msgs[2:]
    third = client.chat.completions.create(model=MODEL, messages=edited, temperature=0,
                                           max_tokens=4, extra_body={"session_id": "ada"})
    assert third.model_extra["session"]["reencoded"]


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bogus": 1}, 400, "bogus"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400,
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    code, out, _ = post(server, "/v1/chat/completions", None if isinstance(body, bytes) else body,
                        raw=body if isinstance(body, bytes) else None)
    assert code == status and out["error"]["param"] == param and out["error"]["message"]


def test_the_readmes_client_example_runs(server, capsys):
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = re.search(r"```py\n(.*?)```", readme, re.S).group(1)
    code = block.replace("http://127.0.0.1:8000", server).replace('api_key="none"',
                                                                   f'api_key="{KEY}"')
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'id': 'ada'" in out and "'reencoded': False" in out


def test_an_oversize_prompt_is_refused(server):
    code, out, _ = post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 2000})
    assert code == 400 and "over this server's 512" in out["error"]["message"]


def test_the_api_key_is_required(server):
    code, out, _ = post(server, "/v1/completions", {"model": MODEL, "prompt": "a"}, key=None)
    assert code == 401 and out["error"]["type"] == "authentication_error"


def _metric(base, name) -> float:
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith(f"jaxllm_{name} ")))


def test_a_client_that_leaves_frees_its_row_and_a_full_queue_says_429(server, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to one hundred."}],
        max_tokens=48, stream=True)
    next(iter(stream))
    stream.close()  # the connection dropped mid-answer
    # The row is freed at the server's next step. A bound, not a speed check: on a loaded
    # 2-core CI machine a step that has to compile a program (a compilation-cache entry read
    # back truncated, say) took over the 20 s this once allowed; the answer's own 48 tokens
    # would free the row too, later.
    deadline = time.monotonic() + 180
    while _metric(server, "rows_busy") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server, "rows_busy") == 0
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: post(server, "/v1/completions", body), range(8)))
    codes = sorted(o[0] for o in outs)
    assert codes.count(200) >= 2 and 429 in codes
    assert all(o[2].get("retry-after") == "1" for o in outs if o[0] == 429)
    assert _metric(server, "rejected_total") >= 1
    assert ask(client, "Hi").choices[0].message.content  # still serving
