"""The training loop: sharded steps, metrics to JSONL with a progress bar, orbax checkpoints,
exact resume, and the final model exported in jaxllm's format."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Optional

import jax
import numpy as np

from jaxllm import outputs
from jaxllm.io import load_model, save_model
from jaxllm.model import stack_layers, unstack_layers
from jaxllm.tokenizer import load_tokenizer

from . import data as data_lib
from . import sharding as shd
from .checkpoint import Checkpoints
from .config import TrainConfig
from .pose_sampling import pose_batch
from .step import compile_step, flops_per_token, init_state, optimizer, peak_tflops

CONFIG_FILE, METRICS_FILE = "train_config.json", "metrics.jsonl"


def _check_run_dir(out: str, cfg: TrainConfig) -> None:
    """A run directory belongs to one config: resuming with another would mix two runs."""
    path = os.path.join(out, CONFIG_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except ValueError:
            old = None
        if not isinstance(old, dict):
            raise ValueError(f"{path} is not a JSON object (damaged or edited): restore it from "
                             f"a copy, or train into a new --out")
        new = cfg.to_dict()
        keep = ("steps", "log_every", "ckpt_every", "keep", "sink_eval_every", "peak_tflops",
                "export_dtype", "export_shard_mib")  # may change on resume: not the numbers
        diff = sorted(k for k in new if k not in keep and old.get(k) != new[k])
        if diff:
            raise ValueError(f"{out} holds a run with a different config ({', '.join(diff)} "
                             f"differ); resume with the same settings or use a new --out")


def _write_config(out: str, cfg: TrainConfig) -> None:
    """Record the run's config, once everything it names has been built (a config that fails
    to build must not claim the directory)."""
    path = os.path.join(out, CONFIG_FILE)
    os.makedirs(out, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    os.replace(tmp, path)


class RunLock:
    """An exclusive lock on a run directory (``.lock``, holding the owner's pid and host), so
    two runs never train into one directory: the second would resume from the first's
    half-written checkpoints. The OS drops the lock when its process ends, however it ends."""

    def __init__(self, out: str):
        import fcntl
        import socket
        self.path = os.path.join(out, ".lock")
        try:
            os.makedirs(out, exist_ok=True)
            self.f = open(self.path, "a+")
        except OSError as e:
            raise ValueError(f"cannot write into the run directory {out} ({e.strerror}); copy "
                             f"the run to a writable place and run it there") from None
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            owner = self.f.read().strip() or "another process"
            self.f.close()
            raise ValueError(f"{out} is in use by another training run ({owner}); wait for it "
                             f"to finish or train into another --out") from None
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.f.flush()

    def release(self) -> None:
        if not self.f.closed:
            self.f.close()  # closing the file releases the lock


RUN_ENTRIES = {CONFIG_FILE, METRICS_FILE, "checkpoints", "model", ".lock", "heldout.npy",
               "loss.png",  # (the CLI's plot of a finished run)
               "data_manifest.json", outputs.RUN_MANIFEST,  # (heldout, manifest: _record_data)
               "train.log"}  # (train.experiments.sink_token's log of a variant's run)


def _legacy_run(path: str) -> bool:
    """A run directory from before manifests (its config and nothing but a run's entries), or
    one holding only our lock."""
    entries = set(os.listdir(path))
    return entries <= RUN_ENTRIES and (CONFIG_FILE in entries or entries == {".lock"})


def _finished_products(out: str, cfg: TrainConfig) -> list:
    """What a finished run in ``out`` holds (its metrics, its model), or [] when it did not
    finish: an unfinished run with no checkpoint simply starts over, as it would resume."""
    model = os.path.join(out, "model")
    metrics = os.path.join(out, METRICS_FILE)
    last = 0
    if os.path.exists(metrics):
        last = max([r["step"] for r in metric_records(metrics)[0]], default=0)
    if not os.path.isdir(model) and last < cfg.steps:
        return []
    return [p for p in (METRICS_FILE, "model") if os.path.exists(os.path.join(out, p))]


def _has_checkpoints(out: str) -> bool:
    d = os.path.join(out, "checkpoints")
    return os.path.isdir(d) and any(e.isdigit() for e in os.listdir(d))


def metric_records(path: str) -> tuple[list[dict], int]:
    """A metrics.jsonl's records, and how many lines were not records (a line torn by a kill
    mid-write, or edited): those are skipped, never fatal."""
    records, bad = [], 0
    with open(path) as f:
        for ln in f:
            if not ln.strip():
                continue
            try:
                r = json.loads(ln)
                ok = isinstance(r, dict) and isinstance(r.get("step"), int) and \
                    isinstance(r.get("loss"), (int, float))
            except ValueError:
                ok = False
            if ok:
                records.append(r)
            else:
                bad += 1
    return records, bad


def _truncate_metrics(path: str, step: int) -> None:
    """Drop log lines past the restored step (written by the run that was interrupted), and
    lines that are not records (saying how many)."""
    if not os.path.exists(path):
        return
    records, bad = metric_records(path)
    if bad:
        print(f"note: {path}: dropped {bad} line(s) that were not metrics records (a line cut "
              f"by an interrupted write, or an edit)", file=sys.stderr)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records if r["step"] <= step)
    os.replace(path + ".tmp", path)


HELDOUT_FILE, MANIFEST_FILE = "heldout.npy", "data_manifest.json"
HELDOUT_KEEP = 1 << 18  # tokens of held-out text saved with the run (512 KB as uint16)


def _record_data(out: str, data: data_lib.PackedData, tokens_path: str) -> None:
    """Keep what an evaluation needs with the run: the start of the held-out stream (a source
    such as ``site`` differs between machines, so it cannot be rebuilt elsewhere) and, where the
    source has one, its manifest (document count, bytes, fingerprint)."""
    path = os.path.join(out, HELDOUT_FILE)
    if data.n_heldout and not os.path.exists(path):
        start = data.n_train * data.L
        held = np.asarray(data.tokens[start:start + HELDOUT_KEEP])
        np.save(path + ".tmp.npy", held)
        os.replace(path + ".tmp.npy", path)
    manifest = data_lib.manifest_path(tokens_path)
    if os.path.exists(manifest):
        shutil.copyfile(manifest, os.path.join(out, MANIFEST_FILE))


def heldout_text(run: str, n_tokens: int) -> np.ndarray:
    """The first ``n_tokens`` of a run's held-out stream, as saved by its training."""
    path = os.path.join(run, HELDOUT_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: runs save their held-out text when they "
                                f"start (rerun the training command to resume and write it)")
    held = np.load(path)
    if len(held) < n_tokens:
        raise ValueError(f"{run} saved {len(held)} held-out tokens, fewer than the {n_tokens} "
                         f"asked for; ask for fewer")
    return np.asarray(held[:n_tokens], np.int32)


def heldout_loss(run: str, seq_len: int, windows: int = 8) -> Optional[tuple[float, int]]:
    """The exported model's mean next-token loss (nats) on up to ``windows`` held-out windows
    of ``seq_len`` tokens (each scored from its start, as in training), and the tokens scored;
    None when the run keeps no held-out text."""
    import jax.numpy as jnp
    from jaxllm.model import forward
    path = os.path.join(run, HELDOUT_FILE)
    if not os.path.exists(path):
        return None
    held = np.load(path)
    n = min(windows, len(held) // (seq_len + 1))
    if n == 0:
        return None
    x = np.asarray(held[:n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)
    cfg, params, _ = load_model(os.path.join(run, "model"))
    logits = forward(params, cfg, jnp.asarray(x[:, :-1]))[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(x[:, 1:, None]), axis=-1)
    return float(nll.mean()), n * seq_len


def sink_probe(params, cfg: TrainConfig, text: np.ndarray) -> dict:
    """How sink-like the model is now: the sink metric over the first tokens of held-out
    samples, and window (0+W) vs StreamingLLM (4+W-4) perplexity past the first eviction."""
    from jaxllm.evals.attention import attention_maps, sink_metric
    from jaxllm.policy import StreamingLLM, Window
    from jaxllm.ppl import stream_score
    m = dataclasses.replace(cfg.model, dtype="float32")
    L = min(cfg.seq_len, 256)
    metric = sink_metric(attention_maps(params, m, text[:4 * L].reshape(4, L)))
    W = max(8, cfg.seq_len // 2)
    out = {"sink_metric": metric["overall"], "sink_metric_per_layer": metric["per_layer"]}
    for name, pc in (("window", Window(W)),
                     ("streaming", StreamingLLM(4, W))):
        nll = stream_score(params, m, text, pc)[0][W:]  # after the first eviction
        out[f"ppl_{name}"] = float(np.exp(nll.astype(np.float64).mean()))
    return out


def train(cfg: TrainConfig, out: str, resume: bool = True, progress: bool = True,
          stop_after: Optional[int] = None, distributed: bool = False,
          cache_dir: Optional[str] = None, restart: bool = False) -> dict:
    """Train ``cfg`` into run directory ``out`` (checkpoints/, metrics.jsonl, model/).

    ``out`` must be new, empty or a run directory of ours (jaxllm.outputs.claim_run_dir: its
    manifest is written first); anything else is refused. An existing run in ``out`` is
    resumed from its latest checkpoint (``resume=False`` refuses instead); one that holds
    metrics or a model but no checkpoint (deleted to save disk) is refused unless
    ``restart``, which trains it again from step 0 over them. ``stop_after``: stop after
    that step with a checkpoint (what a preemption leaves).
    ``distributed``: call ``jax.distributed.initialize()`` first (multi-host TPU/GPU; every host
    runs the same command). Returns a summary dict."""
    if distributed:
        jax.distributed.initialize()
    mesh = shd.make_mesh(cfg.mesh_data, cfg.mesh_fsdp)
    n_dev = mesh.devices.size
    micro = cfg.batch_size // cfg.grad_accum
    if micro % n_dev:
        raise ValueError(f"each micro-batch ({cfg.batch_size} / grad_accum {cfg.grad_accum} = "
                         f"{micro} sequences) must split evenly over the {n_dev} devices")
    is_main = jax.process_index() == 0
    if not is_main:
        return _train(cfg, out, resume, progress, stop_after, mesh, cache_dir)
    outputs.claim_run_dir(out, legacy=_legacy_run)
    _check_run_dir(out, cfg)
    products = _finished_products(out, cfg) if not _has_checkpoints(out) else []
    if products and not restart:
        raise ValueError(f"{out} holds a run ({', '.join(products)}) but no checkpoint to "
                         f"resume from; pass --restart to train it again from step 0 over "
                         f"them, or choose a new --out")
    lock = RunLock(out)  # one run per directory
    try:
        return _train(cfg, out, resume, progress, stop_after, mesh, cache_dir)
    finally:
        lock.release()


def _train(cfg: TrainConfig, out: str, resume: bool, progress: bool, stop_after, mesh,
           cache_dir) -> dict:
    n_dev = mesh.devices.size
    is_main = jax.process_index() == 0
    tok = load_tokenizer(cfg.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {cfg.tokenizer} has {tok.vocab_size} ids but the model's "
                         f"vocab_size is {cfg.model.vocab_size}; set model.vocab_size")
    cache_dir = cache_dir or os.path.join(out, "..", ".token_cache")
    tokens = data_lib.tokenize(cfg.data, tok, cache_dir, progress and is_main)
    # PoSE draws each sample from a window of pose_span x seq_len tokens of text.
    sample_len = cfg.seq_len * cfg.pose_span if cfg.pose_target else cfg.seq_len
    data = data_lib.PackedData(tokens, sample_len, cfg.batch_size, cfg.seed, cfg.holdout)

    # The state's shardings: parameters by the logical-axes table, optimizer moments likewise
    # (they mirror the parameters), scalars replicated.
    abstract = jax.eval_shape(lambda: init_state(cfg, jax.random.key(cfg.seed)))
    p_shard = shd.param_shardings(mesh, abstract["params"])
    state_shardings = shardings_of_state(mesh, abstract, p_shard)
    # The key is an argument: a jit of no arguments is a constant to XLA, which then folds the
    # whole initialisation at compile time (minutes for Pythia-160M).
    state = jax.jit(init_state, static_argnums=0, out_shardings=state_shardings)(
        cfg, jax.random.key(cfg.seed))
    if is_main:  # everything the config names has been built: the run may claim the directory
        _write_config(out, cfg)
        _record_data(out, data, data_lib.token_cache_path(cfg.data, tok, cache_dir))
    ckpt = Checkpoints(os.path.join(out, "checkpoints"), cfg.keep)
    start = 0
    latest = ckpt.latest()
    if cfg.init_from and latest is None:
        state = jax.jit(lambda p: {"step": state["step"], "params": p,
                                   "opt_state": optimizer(cfg).init(p)},
                        out_shardings=state_shardings)(weights_from(cfg.init_from,
                                                                    state["params"]))
    if latest is not None:
        if not resume:
            raise ValueError(f"{out} already holds checkpoints (latest step {latest}); resume it "
                             f"or choose a new --out")
        state, dstate, start = ckpt.restore_newest_good(state)
        data.restore(dstate)
    metrics_path = os.path.join(out, METRICS_FILE)
    if is_main:
        _truncate_metrics(metrics_path, start)
    step_fn = compile_step(cfg, state_shardings, shd.batch_sharding(mesh))
    fpt, (peak, peak_source) = flops_per_token(cfg), peak_tflops(cfg)
    probe_text = data.heldout(4 * cfg.seq_len) if cfg.sink_eval_every else None
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)

    from tqdm.auto import tqdm
    bar = tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.sink}-sink", unit="step",
               disable=not (progress and is_main))
    log = open(metrics_path, "a") if is_main else None
    t_last, s_last, last = time.perf_counter(), start, {}
    pc, pi = jax.process_count(), jax.process_index()
    compiled = None

    def make(step):  # the step's batch on the devices, and the data iterator's state after it
        batch = data.next_batch()  # every host draws the same global batch, keeps its rows
        if cfg.pose_target:  # seq_len + 1 tokens at skipping positions below pose_target + 1
            batch = pose_batch(batch, cfg.seq_len + 1, cfg.pose_target + 1, cfg.seed, step)
        rows = cfg.batch_size // pc
        return (jax.tree.map(lambda b: shd.put_batch(mesh, b[pi * rows:(pi + 1) * rows]),
                             batch), data.state())
    batches = Prefetch(make, range(start + 1, end + 1))
    try:
        for step in range(start + 1, end + 1):
            mine, dstate = next(batches)
            if compiled is None:  # compiled once, ahead of the first step: refuse what won't fit
                compiled = step_fn.lower(state, mine, cfg).compile()
                check_fits(step_bytes(compiled), device_limit(), cfg)
            state, m = compiled(state, mine)
            if step % cfg.log_every == 0 or step == end:
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                now = time.perf_counter()
                tps = (step - s_last) * cfg.tokens_per_step / (now - t_last)
                t_last, s_last = now, step
                rec = {"step": step, **m, "tokens": step * cfg.tokens_per_step,
                       "tokens_per_s": tps,
                       "mfu": None if peak is None else tps * fpt / (peak * 1e12 * n_dev),
                       "peak_tflops": peak, "peak_source": peak_source}
                if not np.isfinite(m["loss"]):
                    raise FloatingPointError(f"loss is {m['loss']} at step {step}; the last good "
                                             f"checkpoint is step {ckpt.latest()}: lower lr or "
                                             f"raise warm-up, then resume")
                if cfg.sink_eval_every and (step % cfg.sink_eval_every == 0 or step == end):
                    rec["probe"] = sink_probe(state["params"], cfg, probe_text)
                    t_last = time.perf_counter()  # the probe's time is not training throughput
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                last = rec
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tps:,.0f}")
            bar.update(1)
            if step % cfg.ckpt_every == 0 or step == end:
                ckpt.save(step, state, dstate, force=step == end)
    finally:
        batches.close()
        bar.close()
        if log:
            log.close()
        ckpt.wait()
        ckpt.close()
    summary = {"steps": end, "finished": end == cfg.steps, **{k: v for k, v in last.items()
                                                               if k != "step"}}
    if end == cfg.steps and is_main:
        export_cfg = dataclasses.replace(cfg.model, dtype="float32")
        params = unstack_layers(jax.device_get(state["params"]))  # a model is per layer
        if cfg.export_dtype == "bfloat16":
            params = jax.tree.map(lambda a: np.asarray(a).astype(jax.numpy.bfloat16), params)
        save_model(os.path.join(out, "model"), export_cfg, params, tokenizer=cfg.tokenizer,
                   overwrite=True, shard_bytes=cfg.export_shard_mib << 20)
        summary["model"] = os.path.join(out, "model")
    return summary


class Prefetch:
    """``make(step)`` for each step, run ahead on a host thread (at most ``depth`` waiting), so
    drawing, slicing and copying a batch to the devices overlaps the device's step instead of
    following it. Errors surface at the ``next`` that would have returned the failed item."""

    def __init__(self, make, steps, depth: int = 2):
        import queue
        import threading
        self._q, self._stop = queue.Queue(depth), threading.Event()

        def work():
            for step in steps:
                try:
                    item = make(step)
                except BaseException as e:  # handed to the consumer, raised there
                    item = e
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set() or isinstance(item, BaseException):
                    return
        self._thread = threading.Thread(target=work, name="prefetch", daemon=True)
        self._thread.start()

    def __next__(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def step_bytes(compiled) -> int:
    """Device memory one training step holds at its peak, from XLA's compile-time accounting:
    its arguments (the state, the batch) and temporaries, plus outputs not written in place of
    a donated argument."""
    ma = compiled.memory_analysis()
    return (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
            - ma.alias_size_in_bytes)


def device_limit() -> Optional[int]:
    """An accelerator's memory per device (None on a CPU: not known, so nothing is refused)."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def check_fits(need: int, limit: Optional[int], cfg: TrainConfig) -> None:
    """One line before the first step when the step (``need`` bytes, :func:`step_bytes`) cannot
    fit the device's ``limit``."""
    if limit and need > limit:
        raise ValueError(
            f"the training step needs {need / 2**30:.1f} GiB per device (XLA's compile-time "
            f"count: state, batch and temporaries) but the device holds {limit / 2**30:.1f} GiB: "
            f"lower batch_size ({cfg.batch_size}) or raise grad_accum ({cfg.grad_accum}), "
            + ("" if cfg.remat and cfg.scan_layers else
               f"set {'' if cfg.remat else 'remat=true and '}scan_layers=true (each block "
               f"recomputed in the backward pass, under one scan), ")
            + "or shard over more devices (mesh_fsdp)")


def weights_from(path: str, fresh: dict) -> dict:
    """``fresh`` (a new run's parameters) with every tensor taken from the model at ``path``;
    an embedding one row longer (a learnable sink added) keeps its fresh last row. Anything
    else that differs is an error naming the tensor."""
    from jaxllm import tree
    _, base, _ = load_model(path)
    have = tree.flatten(jax.device_get(base))
    out = {}
    stacked = "layers" in fresh  # scan_layers: matched per layer, stacked again after
    for name, x in tree.flatten(unstack_layers(jax.device_get(fresh))).items():
        b = have.get(name)
        if b is not None and b.shape == x.shape:
            out[name] = np.asarray(b, x.dtype)
        elif b is not None and name.endswith("embed/embedding") and \
                b.shape[0] + 1 == x.shape[0] and b.shape[1:] == x.shape[1:]:
            out[name] = np.concatenate([np.asarray(b, x.dtype), np.asarray(x)[-1:]])
        else:
            raise ValueError(f"init_from {path}: tensor {name} is "
                             f"{'missing' if b is None else tuple(b.shape)} where this run needs "
                             f"{tuple(x.shape)}")
    return stack_layers(tree.unflatten(out)) if stacked else tree.unflatten(out)


def shardings_of_state(mesh, abstract, p_shard):
    """Shardings for the whole state: each optimizer leaf shaped like a parameter takes that
    parameter's sharding (Adam's moments), everything else is replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxllm import tree
    by_path = tree.flatten(p_shard)
    replicated = NamedSharding(mesh, P())

    def for_leaf(path, leaf):
        name = tree.keypath_str(path)
        for p, s in by_path.items():
            if name == p or name.endswith("/" + p):
                return s
        return replicated

    opt = jax.tree_util.tree_map_with_path(for_leaf, abstract["opt_state"])
    return {"step": replicated, "params": p_shard, "opt_state": opt}
