"""The train package: data order, the recipe's optimiser, sharded steps, exact resume,
checkpoints that survive an interrupted write, the CLI."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.tokenizer import ByteTokenizer
from train import recipe, train
from train.data import PackedData, iter_texts, tokenize
from train.step import decay_mask, examples, init_state, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["steps=12", "batch_size=4", "seq_len=32", "model.max_seq_len=32", "log_every=1",
        "ckpt_every=4", "model.num_layers=1", "model.hidden_size=32",
        "model.intermediate_size=64"]


def _losses(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


# ---- data ------------------------------------------------------------------------------------
def test_packing_order_is_seeded_and_resumable():
    tokens = np.arange(1000, dtype=np.uint16)
    a = PackedData(tokens, seq_len=9, batch_size=4, seed=3, holdout=0.1)
    n = (1000 - 1) // 9
    assert a.n_heldout == round(n * 0.1) and a.n_train == n - a.n_heldout
    first = [a.next_batch() for _ in range(40)]  # crosses epochs (n_train // 4 batches each)
    b = PackedData(tokens, 9, 4, seed=3, holdout=0.1)
    for _ in range(17):
        b.next_batch()
    c = PackedData(tokens, 9, 4, seed=3, holdout=0.1)
    c.restore(json.loads(json.dumps(b.state())))  # as stored in a checkpoint
    np.testing.assert_array_equal(np.stack(first[17:]), np.stack([c.next_batch()
                                                                  for _ in range(23)]))
    # Every sample is a contiguous slice; held-out text is never trained on.
    for batch in first:
        assert (np.diff(batch, axis=1) == 1).all() and batch.shape == (4, 10)
        assert batch.max() < a.n_train * 9 + 1
    np.testing.assert_array_equal(a.heldout(50), np.arange(a.n_train * 9, a.n_train * 9 + 50))
    # One epoch visits every training sample once.
    d = PackedData(tokens, 9, 1, seed=0)
    starts = sorted(int(d.next_batch()[0, 0]) for _ in range(d.n_train))
    assert starts == list(range(0, 9 * d.n_train, 9))
    other = PackedData(tokens, 9, 4, seed=4, holdout=0.1)
    assert not np.array_equal(other.next_batch(), PackedData(tokens, 9, 4, 3, 0.1).next_batch())
    with pytest.raises(ValueError, match="seed=3"):
        other.restore(b.state())
    # An edited position: one line (it was numpy's "need at least one array to stack").
    for edit in ({"index": -4}, {"index": 10 ** 9}, {"index": 3}, {"epoch": "1"}):
        with pytest.raises(ValueError, match="is not one this data reaches"):
            c.restore({**b.state(), **edit})
    with pytest.raises(ValueError, match=r"lacks \['index'\]"):
        c.restore({k: v for k, v in b.state().items() if k != "index"})


def test_sources_text_jsonl_parquet_dir(tmp_path):
    from jaxllm.tokenizer import ByteTokenizer
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["pq1", "pq2"]}), tmp_path / "c.parquet")
    assert list(iter_texts(str(tmp_path))) == ["hello", "one", "two", "pq1", "pq2"]
    tok = ByteTokenizer()
    ids = tokenize(str(tmp_path / "b.jsonl"), tok, str(tmp_path / "cache"))
    assert list(ids) == list(b"one") + [tok.eos_id] + list(b"two") + [tok.eos_id]
    assert ids.dtype == np.uint16 and len(os.listdir(tmp_path / "cache")) == 1
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*'text' field"):
        list(iter_texts(str(tmp_path / "bad.jsonl")))
    with pytest.raises(ValueError, match="neither a file"):
        list(iter_texts("no/such/thing"))
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedData(np.arange(20), 8, 4)
    stdlib = iter_texts("stdlib")
    assert "def " in next(stdlib)  # the standard library's own source


# ---- recipe --------------------------------------------------------------------------------
def test_site_source_dedups_filters_orders_by_hash_and_records_a_manifest(tmp_path,
                                                                          monkeypatch):
    import hashlib

    from jaxllm.corpus import builtin_corpus
    from jaxllm.tokenizer import ByteTokenizer
    from train import data as data_lib
    root = tmp_path / "site-packages"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg-1.0.dist-info").mkdir()
    files = {"pkg/a.py": "x = 1\n", "pkg/copy_of_a.py": "x = 1\n", "pkg/README.md": "# pkg\n",
             "pkg-1.0.dist-info/METADATA": "Name: pkg\n\nA package.\n",
             "pkg/data.json": "{}", "pkg/__pycache__/a.py": "cached = True\n",
             "pkg/big.txt": "y" * (data_lib.SITE_MAX_BYTES + 1)}
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "pkg" / "latin1.py").write_bytes(b"caf\xe9 = 1\n")  # not UTF-8: skipped
    monkeypatch.setattr(data_lib, "_site_roots", lambda: [str(root)])
    kept = [b"x = 1\n", b"# pkg\n", b"Name: pkg\n\nA package.\n", builtin_corpus().encode()]
    want = sorted((hashlib.sha1(t).hexdigest(), t) for t in kept)
    tok = ByteTokenizer()
    tokens = tokenize("site", tok, str(tmp_path / "cache"))
    expect = np.concatenate([np.frombuffer(t, np.uint8).astype(np.uint16).tolist() + [tok.eos_id]
                             for _, t in want]).astype(np.uint16)
    np.testing.assert_array_equal(tokens, expect)
    path = data_lib.manifest_path(data_lib.token_cache_path("site", tok, str(tmp_path / "cache")))
    manifest = json.load(open(path))
    assert manifest["documents"] == 4 and manifest["bytes"] == sum(len(t) for t in kept)
    assert manifest["fingerprint"] == hashlib.sha1("".join(h for h, _ in want).encode()
                                                   ).hexdigest()


def test_an_edited_corpus_is_tokenized_again(tmp_path, capsys):
    """The token cache is keyed by the corpus's content (size, mtime, inode) and the
    tokenizer's behaviour: a rewritten corpus gives its new tokens, said in one line, and the
    old cache goes (it used to give the old text's tokens: the same loss, silently)."""
    corpus, cache = tmp_path / "c.txt", str(tmp_path / "cache")
    tok = ByteTokenizer()
    corpus.write_text("first text")
    assert bytes(tokenize(str(corpus), tok, cache)[:-1].astype(np.uint8)) == b"first text"
    assert bytes(tokenize(str(corpus), tok, cache)[:-1].astype(np.uint8)) == b"first text"
    assert capsys.readouterr().err == ""
    corpus.write_text("the second, longer text")
    assert bytes(tokenize(str(corpus), tok, cache)[:-1].astype(np.uint8)) == \
        b"the second, longer text"
    assert "changed since it was tokenized" in capsys.readouterr().err
    assert len(os.listdir(cache)) == 1
    # A cache place that cannot be written (a file where its folder would be): tokenized all
    # the same, said in one line (a traceback before).
    (tmp_path / "blocked").write_text("")
    assert bytes(tokenize(str(corpus), tok, str(tmp_path / "blocked" / "cache"))[:-1]
                 .astype(np.uint8)) == b"the second, longer text"
    err = capsys.readouterr().err
    assert "are not cached" in err and err.count("\n") == 1


def test_pythia_recipe_schedule_and_weight_decay_mask():
    cfg = recipe("pythia-160m")
    assert (cfg.lr, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.clip, cfg.dtype) == (
        6e-4, 0.9, 0.95, 1e-8, 0.1, 1.0, "bfloat16")
    assert cfg.model.hidden_size == 768 and cfg.model.num_layers == 12 and cfg.warmup_steps == 1430
    lr = schedule(cfg)
    assert float(lr(0)) == 0.0 and float(lr(715)) == pytest.approx(3e-4)  # linear warm-up
    assert float(lr(1430)) == pytest.approx(6e-4)
    mid = 1430 + (143_000 - 1430) // 2  # cosine: halfway down to 10%
    assert float(lr(mid)) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5), rel=1e-3)
    assert float(lr(143_000)) == pytest.approx(6e-5)
    small = recipe("tiny", ["model.num_layers=1"])
    params = init_state(small, jax.random.key(0))["params"]
    mask = decay_mask(params)
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): v
            for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["layer_0/attn/q/kernel"] and flat["embed/embedding"] and flat["lm_head/kernel"]
    assert not flat["layer_0/attn/q/bias"] and not flat["layer_0/ln_attn/scale"]
    assert not flat["layer_0/ln_attn/bias"] and not flat["ln_final/scale"]
    with pytest.raises(ValueError, match="no field 'lrr'"):
        recipe("tiny", ["lrr=1"])
    with pytest.raises(ValueError, match="takes a number"):
        recipe("tiny", ["lr=fast"])
    assert recipe("tiny", ["model.num_layers=3", "sink=learnable"]).model.sink == "learnable"


@pytest.mark.parametrize("sink,tie", [("none", False), ("learnable", True)])
def test_chunked_loss_equals_the_whole_logits_loss(sink, tie):
    """The loss made a chunk of rows at a time (40 rows: a ragged last chunk) has the value and
    the gradients of the log-softmax over the whole [tokens, vocabulary] logits, for an untied
    head and a tied one (what it saves: benchmarks/train_memory.py)."""
    import dataclasses as dc
    from train.step import init_state, loss_fn
    cfg = recipe("tiny", TINY + [f"sink={sink}", "dtype=float32"])
    cfg = dc.replace(cfg, model=dc.replace(cfg.model, tie_embeddings=tie))
    params = init_state(cfg, jax.random.key(0))["params"]
    batch = jax.random.randint(jax.random.key(1), (4, 33), 0, 200)
    whole, chunked = dc.replace(cfg, loss_chunk=0), dc.replace(cfg, loss_chunk=40)
    l0, g0 = jax.value_and_grad(loss_fn)(params, whole, batch)
    l1, g1 = jax.value_and_grad(loss_fn)(params, chunked, batch)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_remat_gives_the_same_loss_and_gradients_in_less_memory():
    """remat=True recomputes each block in the backward pass: the same loss and gradients, and
    XLA's compile-time count of the gradient's temporaries (8 layers, each with 4 MiB of
    attention probabilities) falls below half of what the gradient that keeps every layer's
    activations holds. jax.checkpoint left the count unchanged on a CPU (model._recomputed)."""
    import dataclasses as dc
    from train.step import init_state, loss_fn
    cfg = recipe("tiny", TINY + ["model.num_layers=2", "dtype=float32"])
    params = init_state(cfg, jax.random.key(0))["params"]
    batch = jax.random.randint(jax.random.key(1), (4, 33), 0, 200)
    l0, g0 = jax.value_and_grad(loss_fn)(params, cfg, batch)
    l1, g1 = jax.value_and_grad(loss_fn)(params, dc.replace(cfg, remat=True), batch)
    assert float(l1) == float(l0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)

    big = recipe("tiny", TINY + ["model.num_layers=8", "dtype=float32", "seq_len=256",
                                 "model.max_seq_len=256"])
    S = jax.ShapeDtypeStruct
    p = jax.eval_shape(lambda k: init_state(big, k)["params"], jax.random.key(0))
    tokens = S((4, 257), jnp.int32)

    def temp(c):
        grad = jax.jit(jax.grad(loss_fn), static_argnums=1)
        return grad.lower(p, c, tokens).compile().memory_analysis().temp_size_in_bytes
    plain_b, remat_b = temp(big), temp(dc.replace(big, remat=True))
    assert remat_b < plain_b / 2, (plain_b / 2 ** 20, remat_b / 2 ** 20)


def test_scanned_layers_train_as_the_unrolled_ones():
    """scan_layers=true (the blocks stacked, the forward one scan): the loss and gradients of
    the per-layer model, with and without remat, and weight decay on the same tensors."""
    import dataclasses as dc
    from jaxllm.model import unstack_layers
    from train.step import loss_fn
    cfg = recipe("tiny", TINY + ["model.num_layers=3", "dtype=float32"])
    scan = dc.replace(cfg, scan_layers=True)
    params = init_state(cfg, jax.random.key(0))["params"]
    stacked = init_state(scan, jax.random.key(0))["params"]
    assert set(stacked) == set(params) - {"layer_0", "layer_1", "layer_2"} | {"layers"}
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked), params)
    mask = decay_mask(stacked)
    assert mask["layers"] == decay_mask(params)["layer_0"] and mask["layers"]["attn"]["q"] == {
        "kernel": True, "bias": False}
    batch = jax.random.randint(jax.random.key(1), (4, 33), 0, 200)
    grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)
    l0, g0 = grad(params, cfg, batch)  # (remat's own test: the same with remat)
    for remat in (False, True):
        l1, g1 = grad(stacked, dc.replace(scan, remat=remat), batch)
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                     unstack_layers(g1), g0)


def test_scanned_layers_compile_one_block_whatever_the_depth():
    """The remat gradient with scan_layers compiles to one block's code (4 layers make about
    the program of 2, where the unrolled program grows with every layer), and XLA counts no
    more temporaries for it than for the unrolled one (the Pythia-160M step: 10.8 -> 6.3 GiB,
    benchmarks/train_memory.py)."""
    import dataclasses as dc
    from train.step import loss_fn
    cfg = recipe("tiny", TINY + ["dtype=float32", "remat=true", "seq_len=128",
                                 "model.max_seq_len=128"])

    def compiled(scan, layers):
        c = dc.replace(cfg, scan_layers=scan, model=dc.replace(cfg.model, num_layers=layers))
        p = jax.eval_shape(lambda k: init_state(c, k)["params"], jax.random.key(0))
        tokens = jax.ShapeDtypeStruct((4, c.seq_len + 1), jnp.int32)
        return jax.jit(jax.grad(loss_fn), static_argnums=1).lower(p, c, tokens).compile()
    (s2, s4), (u2, u4) = ([compiled(scan, n) for n in (2, 4)] for scan in (True, False))
    size = [len(c.as_text().splitlines()) for c in (s2, s4, u2, u4)]
    assert size[1] < 1.1 * size[0] and size[3] > 1.6 * size[2], size
    temp = [c.memory_analysis().temp_size_in_bytes for c in (s4, u4)]
    assert temp[0] <= 1.05 * temp[1], temp


def test_learnable_sink_examples_never_target_the_sink():
    cfg = recipe("tiny", ["sink=learnable"])
    batch = jnp.arange(2 * 9).reshape(2, 9) % 200
    x, y, pos = examples(cfg, batch)
    assert x.shape == y.shape == (2, 8) and pos is None
    assert (x[:, 0] == cfg.model.sink_id).all() and (y != cfg.model.sink_id).all()
    np.testing.assert_array_equal(x[:, 1:], batch[:, :7])
    np.testing.assert_array_equal(y, batch[:, :8])
    x0, y0, _ = examples(dataclasses.replace(cfg, sink="none"), batch)
    np.testing.assert_array_equal(x0, batch[:, :8])
    np.testing.assert_array_equal(y0, batch[:, 1:])
    # PoSE: the sink at position 0, the tokens one position up
    pos = jnp.asarray([[0, 1, 2, 9, 10, 11, 12, 13, 14]] * 2)
    _, _, p = examples(cfg, (batch, pos))
    np.testing.assert_array_equal(p[0], [0, 1, 2, 3, 10, 11, 12, 13])


# ---- sharding -------------------------------------------------------------------------------
SHARDED = textwrap.dedent("""
    import os, sys
    # (added to the session's flags: its LLVM level 0 keeps compiling cheap, conftest.py)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from train import recipe, sharding as shd
    from train.loop import shardings_of_state
    from train.step import compile_step, init_state
    assert len(jax.devices()) == 8
    cfg = recipe("tiny", ["batch_size=16", "model.hidden_size=64", "model.num_layers=1",
                          "seq_len=32", "model.max_seq_len=32"])
    batch = np.random.default_rng(0).integers(0, 256, (16, cfg.seq_len + 1)).astype(np.int32)

    def run(mesh, cfg):
        abstract = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
        sh = shardings_of_state(mesh, abstract, shd.param_shardings(mesh, abstract["params"]))
        state = jax.jit(lambda: init_state(cfg, jax.random.key(0)), out_shardings=sh)()
        step = compile_step(cfg, sh, shd.batch_sharding(mesh))
        losses = []
        for _ in range(2):
            state, m = step(state, shd.put_batch(mesh, batch), cfg)
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state["params"]), state

    ref_losses, ref_params, _ = run(shd.make_mesh(devices=jax.devices()[:1]), cfg)
    # the second with the blocks stacked (scan_layers): the layer axis whole, the rest sharded
    from jaxllm.model import unstack_layers
    for data, fsdp, accum, scan in [(1, 8, 1, False), (2, 4, 2, True)]:
        c = cfg.override([f"grad_accum={accum}", f"scan_layers={str(scan).lower()}"])
        losses, params, state = run(shd.make_mesh(data, fsdp), c)
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4),
                     unstack_layers(params), ref_params)
        name = "layers" if scan else "layer_0"
        k = state["params"][name]["mlp"]["up"]["kernel"]
        mu = state["opt_state"][1][0].mu[name]["mlp"]["up"]["kernel"]
        spec = P(None, "fsdp", None) if scan else P("fsdp", None)
        assert k.sharding.spec == mu.sharding.spec == spec, (k.sharding, mu.sharding)
        # each device holds 1/fsdp of the parameter and of its Adam moment
        assert k.addressable_shards[0].data.shape == mu.addressable_shards[0].data.shape == (
            (1,) if scan else ()) + (64 // fsdp, 256)
        print("ok", data, fsdp, accum, scan, losses)
""")


def test_sharded_step_equals_one_device():
    """fsdp 8, and data 2 x fsdp 4 with 2 accumulated micro-batches, each against one device:
    8 simulated CPU devices in one fresh process (the device count is fixed at JAX start-up;
    one process for the meshes shares the start-up and the reference run); the second with the
    blocks stacked (scan_layers). A data-only mesh is left out: the 2 x 4 mesh runs the same
    data-axis code."""
    out = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 2


# ---- resume and checkpoints -----------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("full") / "run")
    train(recipe("tiny", TINY), run, progress=False)
    return _losses(run)


def test_stop_and_resume_reproduces_losses_exactly(uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY)
    s = train(cfg, run, progress=False, stop_after=6)
    assert s["steps"] == 6 and not s["finished"] and "model" not in s
    assert _losses(run) == uninterrupted[:6]
    s = train(cfg, run, progress=False)
    assert s["finished"] and os.path.exists(os.path.join(run, "model", "config.json"))
    assert _losses(run) == uninterrupted  # bit-exact: same state, same sample order
    # The run keeps the start of its held-out text (evaluations elsewhere need no data source).
    from train.loop import heldout_text
    toks = tokenize(cfg.data, __import__("jaxllm").ByteTokenizer())
    n = (len(toks) - 1) // cfg.seq_len
    start = (n - round(n * cfg.holdout)) * cfg.seq_len
    np.testing.assert_array_equal(heldout_text(run, 100), toks[start:start + 100])
    with pytest.raises(ValueError, match="fewer than"):
        heldout_text(run, 10 ** 9)
    with pytest.raises(ValueError, match="different config .*lr"):
        train(recipe("tiny", TINY + ["lr=1e-4"]), run, progress=False)


def test_pose_run_resumes_exactly(tmp_path):
    """PoSE (--pose 256 at seq_len 32): samples at skipping positions up to 256, redrawn the
    same after a stop, so a resumed run reproduces the uninterrupted one's losses bit-exactly."""
    from train.pose_sampling import pose_batch
    cfg = recipe("tiny", TINY + ["pose_target=256", "steps=8"])
    full = str(tmp_path / "full")
    train(cfg, full, progress=False)
    run = str(tmp_path / "run")
    train(cfg, run, progress=False, stop_after=3)
    train(cfg, run, progress=False)
    assert _losses(run) == _losses(full) and len(_losses(full)) == 8
    toks, pos = pose_batch(np.arange(4 * 161).reshape(4, 161), 33, 257, 0, 1)
    assert toks.shape == pos.shape == (4, 33) and pos.max() > 33 and (pos < 257).all()
    with pytest.raises(ValueError, match="pose_target .* must exceed seq_len"):
        recipe("tiny", TINY + ["pose_target=16"])


def test_parallel_variants_train_as_they_would_alone(uninterrupted, tmp_path):
    """--parallel trains each variant in its own process; the vanilla one must see exactly the
    losses of a run made alone."""
    from train.experiments.sink_token import main as experiment
    out = str(tmp_path / "exp")
    assert experiment(["--preset", "tiny", "--out", out, "--parallel", "--train-only"]
                      + [x for o in TINY for x in ("--set", o)]) == 0
    assert _losses(os.path.join(out, "none")) == uninterrupted
    for v in ("zero", "learnable"):
        cfg = json.load(open(os.path.join(out, v, "model", "config.json")))
        assert cfg["model"]["sink"] == v and len(_losses(os.path.join(out, v))) == 12


def test_killed_run_resumes_exactly(uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "train", "run", "--preset", "tiny", "--out", run]
    cmd += [x for o in TINY for x in ("--set", o)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).readlines()) >= 6:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: mid-step, maybe mid-write
    proc.wait()
    train(recipe("tiny", TINY), run, progress=False)
    assert _losses(run) == uninterrupted


def test_corrupt_latest_checkpoint_resumes_from_the_one_before(uninterrupted, tmp_path,
                                                                capsys):
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY)
    train(cfg, run, progress=False, stop_after=8)  # checkpoints at steps 4 and 8
    step8 = os.path.join(run, "checkpoints", "8")
    files = [os.path.join(d, f) for d, _, fs in os.walk(step8) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:  # a write cut short: half the largest file is gone
        f.truncate(os.path.getsize(big) // 2)
    train(cfg, run, progress=False)
    err = capsys.readouterr().err
    assert "checkpoint step 8" in err and "moved to" in err
    kept = os.listdir(os.path.join(run, "checkpoints", "quarantine"))  # evidence, kept
    assert sorted(kept) == ["8", "8.digests.json"]
    assert _losses(run) == uninterrupted  # resumed from step 4, bit-exact


def test_one_run_per_directory(tmp_path):
    from train.loop import RunLock
    run = str(tmp_path / "run")
    held = RunLock(run)  # another run holding the directory
    with pytest.raises(ValueError, match=r"in use by another training run \(pid \d+ on "):
        train(recipe("tiny", TINY), run, progress=False)
    held.release()
    # a config that fails to build claims nothing: the directory stays free for a good one
    with pytest.raises(ValueError, match="vocab_size"):
        train(recipe("tiny", TINY + ["model.vocab_size=100"]), run, progress=False)
    assert not os.path.exists(os.path.join(run, "train_config.json"))
    assert train(recipe("tiny", TINY + ["steps=2"]), run, progress=False)["finished"]


INTERRUPTED_WRITE = textwrap.dedent("""
    import os, sys, jax, jax.numpy as jnp
    from train.checkpoint import Checkpoints
    ck = Checkpoints(sys.argv[1], keep=3)
    big = {"w": jnp.ones((64, 1024, 1024), jnp.float32)}  # 256 MB: the write takes a while
    ck.save(1, big, {"epoch": 0, "index": 1})
    ck.wait()
    ck.save(2, jax.tree.map(lambda x: x * 2, big), {"epoch": 0, "index": 2})
    os._exit(1)  # the process dies while step 2 is being written
""")


def test_interrupted_checkpoint_write_leaves_previous_restorable(tmp_path):
    d = str(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_WRITE, d], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    from train.checkpoint import Checkpoints
    ck = Checkpoints(d, keep=3)
    assert ck.latest() == 1
    like = {"w": jnp.zeros((64, 1024, 1024), jnp.float32)}
    state, data = ck.restore(1, like)
    assert data == {"epoch": 0, "index": 1} and float(state["w"].min()) == 1.0
    ck.close()


def test_cli_run_and_plot(tmp_path, uninterrupted):
    run = str(tmp_path / "cli")
    base = [sys.executable, "-m", "train"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = base + ["run", "--preset", "tiny", "--out", run, "--sink", "learnable", "--steps", "3"]
    cmd += [x for o in TINY[1:] for x in ("--set", o)]
    summary = str(tmp_path / "summary.json")
    out = subprocess.run(cmd + ["--json", summary], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.load(open(summary))
    assert s["finished"] and os.path.getsize(s["loss_png"]) > 1000
    # The held-out loss, against one computed here from the saved held-out tokens and model.
    import numpy as np
    from jaxllm import load_model
    from jaxllm.model import forward
    cfg, params, _ = load_model(os.path.join(run, "model"))
    L = json.load(open(os.path.join(run, "train_config.json")))["seq_len"]
    held = np.load(os.path.join(run, "heldout.npy"))[:s["heldout_tokens"] // L * (L + 1)]
    x = held.reshape(-1, L + 1).astype(np.int32)
    logits = np.asarray(forward(params, cfg, jnp.asarray(x[:, :-1]))[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)
    want = -np.take_along_axis(logp, x[:, 1:, None], -1).mean()
    assert abs(s["heldout_loss"] - want) < 1e-4
    assert f"held-out loss {s['heldout_loss']:.4f}" in out.stdout
    assert f"jaxllm generate --model {os.path.join(run, 'model')}" in out.stdout
    saved = json.load(open(os.path.join(run, "model", "config.json")))
    assert saved["model"]["sink"] == "learnable"
    png = str(tmp_path / "loss.png")
    out = subprocess.run(base + ["plot", f"sink={run}", "--out", png], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and os.path.getsize(png) > 1000
    # This run logged no sink probes: --probes says how to get them, in one line.
    out = subprocess.run(base + ["plot", run, "--probes", "--out", str(tmp_path / "p.png")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "logged no sink probes (train with --set sink_eval_every=N)" \
        in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    bad = subprocess.run(base + ["run", "--preset", "tiny", "--out", run, "--mesh", "data=x"],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "data=2,fsdp=4" in bad.stderr


def test_embedded_corpus_is_the_same_in_every_process():
    # pytest replaces sys.unraisablehook; the corpus must not notice (resumed runs and the
    # uninterrupted one would otherwise train on different text).
    from jaxllm.corpus import builtin_corpus
    code = "from jaxllm.corpus import builtin_corpus as b; import hashlib; " \
           "print(hashlib.sha1(b().encode()).hexdigest())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    import hashlib
    assert fresh.stdout.strip() == hashlib.sha1(builtin_corpus().encode()).hexdigest()


def test_init_from_copies_weights_and_keeps_a_new_sink_row(tmp_path):
    """Fine-tuning starts from a model directory: every tensor copied, a learnable sink's extra
    embedding row kept fresh; a tensor of another shape is named."""
    import jax

    import jaxllm
    from train.loop import weights_from
    cfg = recipe("tiny", TINY).model
    base = jaxllm.init_params(cfg, jax.random.key(1))
    jaxllm.save_model(str(tmp_path / "m"), cfg, base)
    sink_cfg = dataclasses.replace(cfg, sink="learnable")
    fresh = jaxllm.init_params(sink_cfg, jax.random.key(2))
    got = weights_from(str(tmp_path / "m"), fresh)
    emb = np.asarray(got["embed"]["embedding"])
    np.testing.assert_array_equal(emb[:-1], np.asarray(base["embed"]["embedding"]))
    np.testing.assert_array_equal(emb[-1], np.asarray(fresh["embed"]["embedding"])[-1])
    np.testing.assert_array_equal(np.asarray(got["layer_0"]["mlp"]["up"]["kernel"]),
                                  np.asarray(base["layer_0"]["mlp"]["up"]["kernel"]))
    # a run with its blocks stacked (scan_layers) gets them stacked, taken from the same layers
    from jaxllm.model import stack_layers
    jax.tree.map(np.testing.assert_array_equal, weights_from(str(tmp_path / "m"),
                                                             stack_layers(fresh)),
                 stack_layers(got))
    wide = jaxllm.init_params(dataclasses.replace(cfg, intermediate_size=96), jax.random.key(0))
    with pytest.raises(ValueError, match=r"tensor layer_0/mlp/\w+/kernel is \(\d+, \d+\) where"):
        weights_from(str(tmp_path / "m"), wide)


# ---- a step worth a GPU: export, memory, MFU, prefetch -----------------------------------------
def test_finished_run_exports_bfloat16_in_shards(tmp_path, uninterrupted):
    """export_dtype / export_shard_mib: the finished model comes back in bfloat16, split into
    files under the limit with an index, and loads as the run's weights rounded to bfloat16.
    Each record reports where its MFU's peak rate came from (none on a CPU)."""
    import jaxllm
    from train.checkpoint import Checkpoints
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY + ["steps=2", "ckpt_every=2", "export_dtype=bfloat16",
                                 "export_shard_mib=1", "model.hidden_size=256",
                                 "model.intermediate_size=1024", "model.num_layers=2"])
    train(cfg, run, progress=False)  # 1.7M parameters: 3.4 MB in bfloat16
    model = os.path.join(run, "model")
    shards = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
    assert len(shards) >= 4 and all(os.path.getsize(os.path.join(model, f)) <= 1 << 20
                                    for f in shards)
    _, params, _ = jaxllm.load_model(model)
    ck = Checkpoints(os.path.join(run, "checkpoints"), 3)
    final = ck.restore(2, init_state(cfg, jax.random.key(0)))[0]["params"]
    ck.close()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(final)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    rec = json.loads(open(os.path.join(run, "metrics.jsonl")).readline())
    assert rec["peak_source"] == "none" and rec["mfu"] is None


def test_shards_refuse_what_they_cannot_hold_or_should_not_read(tmp_path):
    import jaxllm
    cfg = recipe("tiny", TINY).model
    params = jaxllm.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match=r"tensor embed/embedding takes 33 KiB, more than a "
                                         r"shard of 1 KiB"):
        jaxllm.save_model(str(tmp_path / "m"), cfg, params, shard_bytes=1000)
    jaxllm.save_model(str(tmp_path / "m"), cfg, params, shard_bytes=40_000)
    index = tmp_path / "m" / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    name = next(iter(meta["weight_map"]))
    meta["weight_map"][name] = "../elsewhere/model-00001-of-00001.safetensors"
    index.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="outside the model directory"):
        jaxllm.load_model(str(tmp_path / "m"))
    index.write_text(json.dumps({"weight_map": ["not", "a", "map"]}))
    with pytest.raises(ValueError, match="no weight_map"):
        jaxllm.load_model(str(tmp_path / "m"))


def test_a_step_that_cannot_fit_is_refused_in_one_line():
    """XLA's compile-time count against the device's memory, before the first step."""
    from train.loop import check_fits
    cfg = recipe("tiny", TINY)
    check_fits(10 << 30, None, cfg)  # a CPU: the limit is not known
    check_fits(10 << 30, 11 << 30, cfg)
    with pytest.raises(ValueError) as e:
        check_fits(97 << 30, 80 << 30, cfg)
    msg = str(e.value)
    assert "\n" not in msg and "97.0 GiB" in msg and "80.0 GiB" in msg and "grad_accum" in msg
    assert "remat=true and scan_layers=true" in msg
    with pytest.raises(ValueError, match="set scan_layers=true") as e:
        check_fits(97 << 30, 80 << 30, cfg.override(["remat=true"]))
    assert "remat=true" not in str(e.value)


def test_peak_rate_for_mfu_and_prefetch_errors():
    """MFU's rate: set, or measured on an accelerator (the measurement itself runs anywhere);
    a batch that fails on the prefetch thread raises at the step that needed it."""
    from train.loop import Prefetch
    from train.step import measured_tflops, peak_tflops
    assert peak_tflops(recipe("tiny", ["peak_tflops=123"])) == (123.0, "set")
    assert peak_tflops(recipe("tiny")) == (None, "none")
    assert measured_tflops(n=64, reps=2) > 0

    def make(step):
        if step == 3:
            raise OSError("disk gone")
        return step
    it = Prefetch(make, range(1, 6))
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    it.close()


def test_unreadable_checkpoint_is_named_and_left_in_place(uninterrupted, tmp_path,
                                                          monkeypatch):
    """A checkpoint this process cannot read (a run copied from another user) is not corrupt:
    the run refuses in one line naming the file, and every checkpoint stays where it was."""
    import train.checkpoint as ck
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY)
    train(cfg, run, progress=False, stop_after=8)
    before = sorted(os.listdir(os.path.join(run, "checkpoints")))
    real_access = os.access
    monkeypatch.setattr(ck.os, "access", lambda p, mode: False if os.sep + "8" + os.sep in p
                        + os.sep else real_access(p, mode))
    with pytest.raises(ValueError, match=r"checkpoint step 8 cannot be read \(.*permission"):
        train(cfg, run, progress=False)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == before
    assert not os.path.exists(os.path.join(run, "checkpoints", "quarantine"))


# ---- nothing lost: run directories and checkpoints (jaxllm.outputs, train.checkpoint) -------
def _tree_digests(root) -> dict:
    from test_nothing_lost import digests
    return digests(root)


def test_a_run_directory_with_someone_elses_files_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "their_tool": 0.5}\n')
    before = _tree_digests(run)
    with pytest.raises(ValueError, match=r"is not a jaxllm run directory \(metrics.jsonl\)"):
        train(recipe("tiny", TINY), str(run), progress=False)
    assert _tree_digests(run) == before


def test_a_finished_run_without_checkpoints_is_not_started_over(tmp_path):
    """Checkpoints deleted to save disk: the same command refuses (naming what it would
    overwrite) instead of overwriting metrics.jsonl and model/; --restart trains again."""
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY + ["steps=2"])
    assert train(cfg, run, progress=False)["finished"]
    shutil.rmtree(os.path.join(run, "checkpoints"))
    before = _tree_digests(run)
    with pytest.raises(ValueError, match=r"holds a run \(metrics.jsonl, model\) but no "
                                         r"checkpoint.*--restart"):
        train(cfg, run, progress=False)
    assert _tree_digests(run) == before
    assert train(cfg, run, progress=False, restart=True)["finished"]
    assert [s for s, _ in _losses(run)] == [1, 2]


def test_a_flipped_bit_in_a_checkpoint_is_caught_by_its_digests(uninterrupted, tmp_path,
                                                                 capsys):
    """Same size, one bit different: orbax would restore other numbers; the digests sealed
    at commit catch it, the step goes to quarantine/8, the run resumes from step 4."""
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY)
    train(cfg, run, progress=False, stop_after=8)
    step8 = os.path.join(run, "checkpoints", "8")
    assert os.path.exists(os.path.join(run, "checkpoints", "digests", "8.json"))
    files = [os.path.join(d, f) for d, _, fs in os.walk(step8) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    flipped = _tree_digests(step8)
    train(cfg, run, progress=False)
    err = capsys.readouterr().err
    assert "checkpoint step 8" in err and "differs from its digest" in err
    assert _tree_digests(os.path.join(run, "checkpoints", "quarantine", "8")) == flipped
    assert _losses(run) == uninterrupted


def _as_user(code: str, tmp_path):
    """Run ``code`` in a fresh Python without root's file-permission override."""
    from test_nothing_lost import _drop_root
    return subprocess.run(_drop_root([sys.executable, "-c", code]), cwd=ROOT,
                          capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))


def test_unreadable_and_read_only_runs_refuse_and_touch_nothing(tmp_path):
    """A checkpoint file this user may not read (a run copied from another user), and a whole
    run on a read-only place: one line each, nothing moved, nothing deleted."""
    run = str(tmp_path / "run")
    cfg_args = TINY
    train(recipe("tiny", cfg_args), run, progress=False, stop_after=8)
    code = ("from train.loop import train; from train.config import recipe\n"
            f"try:\n    train(recipe('tiny', {cfg_args!r}), {run!r}, progress=False)\n"
            "except ValueError as e:\n    print(e); raise SystemExit(2)\n")
    step8 = os.path.join(run, "checkpoints", "8")
    victim = max((os.path.join(d, f) for d, _, fs in os.walk(step8) for f in fs),
                 key=os.path.getsize)
    os.chmod(victim, 0)
    before = sorted(os.path.relpath(os.path.join(d, f), run)  # (names: one is unreadable)
                    for d, _, fs in os.walk(run) for f in fs)
    try:
        p = _as_user(code, tmp_path)
    finally:
        os.chmod(victim, 0o644)
    assert p.returncode == 2 and "checkpoint step 8 cannot be read" in p.stdout, p.stderr[-2000:]
    assert sorted(os.path.relpath(os.path.join(d, f), run)
                  for d, _, fs in os.walk(run) for f in fs) == before
    digests_before = _tree_digests(run)
    for d, dirs, fs in os.walk(run):  # the run on a read-only share
        for x in [d] + [os.path.join(d, f) for f in fs]:
            os.chmod(x, os.stat(x).st_mode & ~0o222)
    try:
        p = _as_user(code, tmp_path)
    finally:
        for d, dirs, fs in os.walk(run):
            for x in [d] + [os.path.join(d, f) for f in fs]:
                os.chmod(x, os.stat(x).st_mode | 0o200)
    assert p.returncode == 2 and "cannot write into the run directory" in p.stdout, \
        (p.stdout, p.stderr[-2000:])
    assert len(p.stdout.strip().splitlines()) == 1
    assert _tree_digests(run) == digests_before


def test_torn_metrics_and_damaged_run_files_are_one_line_or_skipped(uninterrupted, tmp_path,
                                                                     capsys):
    """A metrics line cut by a kill, a line without "step", a digests file that is `[]`: the run
    resumes (the lines dropped, said; the step quarantined) with the uninterrupted losses. A
    train_config.json that is `[]`: one line. (Each was a traceback or blocked resuming.)"""
    run = str(tmp_path / "run")
    cfg = recipe("tiny", TINY)
    train(cfg, run, progress=False, stop_after=8)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"loss": 1.0}\n{"step": 9, "lo')
    with open(os.path.join(run, "checkpoints", "digests", "8.json"), "w") as f:
        f.write("[]")
    from train.plot import read_metrics
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    train(cfg, run, progress=False)
    err = capsys.readouterr().err
    assert "dropped 2 line(s) that were not metrics records" in err
    assert "is not a JSON object of file digests" in err
    assert _losses(run) == uninterrupted
    with open(os.path.join(run, "train_config.json"), "w") as f:
        f.write("[]")
    with pytest.raises(ValueError, match=r"train_config.json is not a JSON object"):
        train(cfg, run, progress=False)


def test_sink_probes_are_logged_and_plotted(tmp_path):
    """--set sink_eval_every=N logs the sink metric and window / StreamingLLM perplexity every
    N steps; `python -m train plot --probes` draws them against training tokens."""
    run = str(tmp_path / "probed")
    train(recipe("tiny", TINY + ["sink_eval_every=6"]), run, progress=False)
    probes = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
              if "probe" in r]
    assert [r["step"] for r in probes] == [6, 12]
    assert all(0 <= r["probe"]["sink_metric"] <= 1 and r["probe"]["ppl_window"] > 1
               for r in probes)
    png = str(tmp_path / "probes.png")
    out = subprocess.run([sys.executable, "-m", "train", "plot", f"tiny={run}", "--probes",
                          "--out", png], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert out.returncode == 0 and os.path.getsize(png) > 1000, out.stderr[-2000:]
