"""Evaluations: the generators checked on hand-written cases, the scorer against oracles and
against greedy decoding, the sink metric on hand-made maps, attention maps against transformers."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.evals import passkey, passkey_task, score_task, streameval_task
from jaxllm.evals import attention as att
from jaxllm.evals.common import Task, exact_matches
from jaxllm.cli import main
from jaxllm.policy import Dense, Recompute, StreamingLLM

TOK = jaxllm.ByteTokenizer()


def test_streameval_stream_is_the_papers_format():
    task = streameval_task(40, TOK.encode, seed=3)
    text = TOK.decode(task.ids)
    lines = text.strip("\n").split("\n")
    values = {int(m[1]): m[2] for m in (re.fullmatch(r"The REGISTER_CONTENT in line (\d+) is <(\d{5})>\.",
                                                        ln) for ln in lines) if m}
    # 40 register lines and a query after lines 20, 30, 40 about lines 0, 10, 20: the query
    # repeats the line's own format, so it also parses as that line
    assert len(lines) == 43
    assert [m["asked"] for m in task.meta] == [0, 10, 20]
    assert [m["line"] for m in task.meta] == [20, 30, 40]
    for (s, e), m in zip(task.spans, task.meta):
        assert TOK.decode(task.ids[s:e]) == values[m["asked"]]
        assert TOK.decode(task.ids[s - 38:s]).endswith(f"in line {m['asked']} is <")
    assert lines[20] == f"The REGISTER_CONTENT in line 0 is <{values[0]}>."


def oracle_hits(task: Task, wrong_spans=()):
    """Per-token hits of a model predicting ``pred`` (default: the text itself)."""
    pred = task.ids[1:].copy()
    for (s, e), digits in wrong_spans:
        pred[s - 1:e - 1] = TOK.encode(digits)
    return pred == task.ids[1:]


def test_streameval_oracle_scores_all_and_repeat_last_scores_none():
    task = streameval_task(120, TOK.encode, seed=1)
    assert exact_matches(oracle_hits(task), task.spans).all()
    # "repeat the last number": answer with the value of the line just before the query
    text = TOK.decode(task.ids)
    wrong = []
    for s, e in task.spans:
        last = re.findall(r"<(\d{5})>", TOK.decode(task.ids[:s]))[-1]
        wrong.append(((s, e), last))
    assert not exact_matches(oracle_hits(task, wrong), task.spans).any()
    assert text.count("REGISTER_CONTENT") == 120 + len(task.spans)


def test_passkey_stream():
    for depth in (0.0, 0.5, 1.0):
        task = passkey_task(800, depth, "31415", TOK.encode)
        text = TOK.decode(task.ids)
        assert abs(len(task.ids) - 800) < 100
        assert text.count("31415") == 3 and text.endswith("The pass key is 31415")
        assert text.startswith(passkey.TASK)  # the PoSE authors' layout: the task first
        body = text[len(passkey.TASK):]
        where = body.index("The pass key is 31415.") / len(body)
        assert abs(where - depth * 0.88) < 0.15  # the question sits after the filler
        assert exact_matches(oracle_hits(task), task.spans).all()
        assert not exact_matches(oracle_hits(task, [(task.spans[0], "00000")]), task.spans).any()
    with pytest.raises(ValueError, match="5 digits"):
        passkey_task(800, 0.5, "123", TOK.encode)


def test_exact_match_equals_greedy_decoding():
    """Teacher-forced exact match must agree with actually generating greedily."""
    cfg = jaxllm.PRESETS["pythia-tiny"]
    params = jaxllm.init_params(cfg, jax.random.key(0))
    prefix = np.asarray(TOK.encode("The REGISTER_CONTENT in line 7 is <"), np.int32)  # 35
    sc = jaxllm.SamplingConfig(max_new_tokens=5)

    def greedy(cache):
        return np.asarray(jaxllm.generate(params, cfg, jnp.asarray(prefix[None]), cache,
                                          sc).tokens[0])
    # with room for the whole stream every policy sees everything; with 4+20 the stream is
    # streamed past eviction, and the generation must use the same cache as the scoring
    cases = [(greedy(jaxllm.init_cache(cfg, 1, sinks=0, window=64, ring=False)),
              [Dense(), StreamingLLM(4, 64), Recompute(4, 64)]),
             (greedy(jaxllm.init_cache(cfg, 1, sinks=4, window=20)),
              [StreamingLLM(4, 24)])]
    for ans, policies in cases:
        for answer, want in ((ans, True), (np.r_[ans[:4], (ans[4] + 1) % 256], False)):
            ids = np.concatenate([prefix, answer, TOK.encode(">.")]).astype(np.int32)
            task = Task(ids, [(len(prefix), len(prefix) + 5)], [{}])
            for pc in policies:
                assert score_task(params, cfg, task, pc, chunk=7).tolist() == [want], (pc, want)


def test_sink_metric_on_hand_made_maps():
    T = 8
    sink = np.zeros((T, T))
    sink[:, 0] = 1.0  # every query attends to token 0 only
    uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    maps = np.stack([np.stack([sink, uniform]), np.stack([uniform, uniform])])  # [L=2, H=2]
    m = att.sink_metric(maps, 0, 0.3)
    # uniform: mean over t of 1/(t+1) = (1 + 1/2 + ... + 1/8) / 8 = 0.34 > 0.3 for k = 0
    assert att.head_attention_to(maps)[1, 0] == pytest.approx(sum(1 / t for t in range(1, 9)) / 8)
    assert m["per_layer"] == [1.0, 1.0] and m["overall"] == 1.0
    m = att.sink_metric(maps, 0, 0.5)
    assert m["per_layer"] == [0.5, 0.0] and m["overall"] == 0.25


def test_attention_maps_match_transformers():
    torch = pytest.importorskip("torch")
    import transformers as tf

    import convert
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.5, initializer_range=0.2),
        attn_implementation="eager").eval()
    cfg, params = convert.from_hf(hf)
    seqs = np.random.default_rng(0).integers(0, 64, (3, 12))
    with torch.no_grad():
        out = hf(torch.as_tensor(seqs), output_attentions=True)
    want = np.stack([a.float().numpy().mean(0) for a in out.attentions])  # [L, H, T, T]
    np.testing.assert_allclose(att.attention_maps(params, cfg, seqs, batch=2), want, atol=1e-5)


def test_cli_evals_write_json_next_to_plot(tmp_path, monkeypatch):
    """Every eval task with its default --out, in an empty working directory (eval_out/ does
    not exist yet: each task must create it before it writes)."""
    from jaxllm.cli import main
    monkeypatch.chdir(tmp_path)
    for args in (["streameval", "--lines", "40", "--cache", "128"],
                 ["passkey", "--lengths", "200", "--depths", "0,1", "--trials", "1",
                  "--cache", "128", "--method", "recompute"],
                 ["sinks", "--n", "2", "--seq-len", "32"],
                 ["qa", "--repeat", "1", "--cache", "64"],
                 ["outliers", "--n-seqs", "2", "--seq-len", "32"]):
        assert main(["eval", *args, "--model", "random:pythia-tiny", "--quiet"]) == 0
        out = tmp_path / "eval_out" / args[0]
        res = json.loads(open(f"{out}.json").read())
        assert res["task"] == args[0] and open(f"{out}.png", "rb").read(4) == b"\x89PNG"
        if args[0] == "sinks":
            assert res["per_layer"] and 0 <= res["overall"] <= 1


def test_qa_stream_and_jsonl(tmp_path):
    from jaxllm.cli import main
    from jaxllm.evals import qa
    task = qa.qa_task(qa.SAMPLE, TOK.encode)
    text = TOK.decode(task.ids)
    assert text.startswith("Question: What colour is the sky on a clear day?\n(A) green (B) blue "
                           "(C) red\nAnswer: B\n\nQuestion: How many legs")
    assert [TOK.decode(task.ids[s:e]) for s, e in task.spans] == ["B", "B", "A", "C"]
    assert exact_matches(oracle_hits(task), task.spans).all()
    assert not exact_matches(oracle_hits(task, [(sp, "D") for sp in task.spans]),
                             task.spans).any()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: needs string fields \['answer'\]"):
        qa.read_jsonl(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in qa.SAMPLE) + "\n")
    assert main(["eval", "qa", "--data", str(good), "--model", "random:pythia-tiny", "--cache",
                 "64", "--out", str(tmp_path / "qa"), "--quiet"]) == 0
    assert json.loads((tmp_path / "qa.json").read_text())["records"] == 4
    assert main(["eval", "qa", "--data", str(bad), "--model", "random:pythia-tiny", "--out", str(tmp_path / "x"), "--quiet"]) == 2


def test_outliers_report_follows_eq4(tmp_path):
    # Eq. 4 with alpha 0.5: s_j = sqrt(max|X_j| / max|W_j|), W the q, k and v kernels that share
    # the normalised input; smoothing divides X_j by s_j and multiplies W's row j by it.
    from jaxllm.evals.outliers import outlier_report
    from jaxllm.smoothquant import CalibConfig
    cfg, params, tok = jaxllm.load_model("random:pythia-tiny")
    ids = np.random.default_rng(0).integers(0, 256, 4000)
    r = outlier_report(params, cfg, ids, alpha=0.5, calib=CalibConfig(n_seqs=4, seq_len=64))
    attn = params["layer_0"]["attn"]
    w_group = np.max([np.abs(np.asarray(attn[n]["kernel"])).max(1) for n in "qkv"], axis=0)
    s = np.sqrt(r["act_before"] / w_group)
    np.testing.assert_allclose(r["act_after"], r["act_before"] / s, rtol=1e-5)
    np.testing.assert_allclose(r["weight_after"],
                               (np.abs(np.asarray(attn["q"]["kernel"])) * s[:, None]).max(1),
                               rtol=1e-5)
    out = str(tmp_path / "outl")
    assert main(["eval", "outliers", "--model", "random:pythia-tiny", "--n-seqs", "4",
                 "--seq-len", "64", "--out", out]) == 0
    saved = json.load(open(out + ".json"))
    assert saved["layer"] == "layer_0/attn/q" and os.path.getsize(out + ".png") > 1000
    assert saved["act_max_over_median_after"] > 0
    assert main(["eval", "outliers", "--model", "random:pythia-tiny", "--layer", "layer_0/attn/o",
                 "--out", out]) == 2  # o reads the attention output: not a smoothed linear


def test_demo_command(tmp_path, capsys):
    out = str(tmp_path / "demo")
    assert main(["demo", "--model", "a=random:pythia-tiny", "--tokens", "300", "--cache", "32",
                 "--sinks", "2", "--positions", "20", "--out", out]) == 0
    printed = capsys.readouterr().out
    r = json.load(open(os.path.join(out, "demo.json")))
    methods = [row["method"] for row in r["rows"]]
    assert methods == ["dense", "window 0+32", "StreamingLLM 2+30", "recompute 2+30, sampled"]
    # The plotted curves are in the JSON, and the printed lines say what the numbers are.
    assert sorted(r["curves"]) == sorted(f"a: {m}" for m in methods[:3])
    assert all(len(c) == 299 for c in r["curves"].values())
    np.testing.assert_allclose([np.exp(np.mean(r["curves"][f"a: {row['method']}"]))
                                for row in r["rows"][:3]], [row["ppl"] for row in r["rows"][:3]],
                               rtol=1e-3)
    # Recompute at 20 seeded positions in [32, 299): each the NLL of the next byte after a plain
    # causal forward over the 2 sinks and the last 30 bytes (written here from the definition),
    # and the StreamingLLM run's NLL at the same positions beside it.
    s = r["sampled"]["a"]
    pos = np.asarray(s["positions"])
    assert len(pos) == 20 == len(set(pos)) and pos.min() >= 32 and pos.max() < 299
    cfg, params, _ = jaxllm.load_model("random:pythia-tiny")
    from jaxllm.corpus import builtin_corpus
    from jaxllm.tokenizer import ByteTokenizer
    ids = np.asarray(ByteTokenizer().encode(builtin_corpus())[:300], np.int32)
    want = []
    for t in pos:
        window = np.concatenate([ids[:2], ids[t - 29:t + 1]])[None]
        logp = jax.nn.log_softmax(jaxllm.forward(params, cfg, jnp.asarray(window))[0][0, -1])
        want.append(-float(logp[ids[t + 1]]))
    np.testing.assert_allclose(s["recompute"], want, atol=2e-4)
    streaming = np.asarray(r["curves"]["a: StreamingLLM 2+30"])
    np.testing.assert_allclose(s["streaming"], streaming[pos], atol=1e-4)
    assert r["rows"][3]["positions"] == 20 and r["wall_s"] > 0
    assert "perplexity per byte" in printed and "peak RSS" not in printed
    assert f"{r['training_context']['a']}-byte training context" in printed
    assert "at the 20 sampled positions StreamingLLM scores" in printed
    kv = {row["method"]: row["kv_mib"] for row in r["rows"]}
    assert kv["dense"] > 9 * kv["StreamingLLM 2+30"]  # 301 slots vs 32
    assert all(np.isfinite(row["ppl"]) and row["tokens_per_s"] > 0 for row in r["rows"])
    assert os.path.getsize(os.path.join(out, "demo.png")) > 1000 and "a" in r["generations"]
    assert main(["demo", "--model", "random:pythia-tiny", "--cache", "4", "--sinks", "4",
                 "--out", out]) == 2
