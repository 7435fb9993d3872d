import os
import sys

# On a GPU, float32 matmuls default to TF32 (10-bit mantissa), and scatter-adds (embedding
# gradients) use atomics, so sums differ run to run. The tests check algorithms against float32
# references and promise bit-exact resumption, so they ask for full float32 products and
# deterministic reductions (both no-ops on a CPU); test_model's gpu test checks the default
# (TF32) path separately, at TF32's tolerance. Subprocesses inherit both.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
if "--xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_deterministic_ops=true").strip()
# The suite's CPU time is mostly XLA compiling tiny programs (hundreds of configs, caches and
# shapes), and half of a compile is LLVM optimising code that then runs for milliseconds. Level 0
# keeps every HLO pass (fusion, layouts: what the programs compute) and skips LLVM's
# optimisations: the sink-token notebook's run takes 43 s of CPU instead of 85. Benchmarks and
# users keep XLA's default. Set XLA_FLAGS with its own --xla_backend_optimization_level to override.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Blockwise attention (jaxllm.attention.flash) in blocks of 8 queries x 8 keys at the tiny models'
# sizes, so every equivalence test runs its many-block paths (with blocks of the default budget
# a tiny model's prompt fits in one).
os.environ.setdefault("JAXLLM_SCORE_BLOCK", "1024")

# One XLA compilation cache for the session and every process it starts (notebook kernels, CLI
# and training subprocesses compile many of the programs the in-process tests already compiled).
# A fresh directory per session (a clean clone starts cold), removed when the session ends.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="jaxllm-test-xla-")
    # Every program, however quick to compile: the tests that switch a code path clear JAX's
    # in-memory caches (jax.clear_caches), and the many tiny programs compiled again after that
    # are most of what this cache saves (tests/test_cache.py: 179 s of CPU with a 0.2 s floor,
    # 108 s without).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import jaxllm  # noqa: E402

# Tiny models: compile in about a second, big enough to exercise GQA, partial rotary, both norms.
NEOX = jaxllm.ModelConfig.gpt_neox(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                   rotary_pct=0.5)
LLAMA = jaxllm.ModelConfig.llama(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                 num_kv_heads=2, intermediate_size=48)


@pytest.fixture(scope="session", params=["neox", "llama"])
def model(request):
    cfg = NEOX if request.param == "neox" else LLAMA
    return cfg, jaxllm.init_params(cfg, jax.random.key(0))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop every compiled program no one holds. XLA:CPU maps each
    loaded executable's code in about 150 memory regions, and jit's caches keep every program
    the suite compiles alive: the full suite reached Linux's limit of 65,530 regions per process
    (vm.max_map_count) at 97% and crashed in XLA (SIGSEGV or SIGABRT, in whichever test compiled
    next). Programs used again recompile, or load from the session's compilation cache."""
    yield
    import gc
    jax.clear_caches()
    gc.collect()


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE:
        import shutil
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests compile the Pallas kernels for real: they need JAX on a GPU. ``cpu`` tests
    check what only XLA:CPU does (its profiler's op names, the CPU kernels' dispatch, bit-level
    equalities between differently compiled programs that hold because XLA:CPU sums in one
    order): each says why where it is marked, and they skip on any other backend."""
    backend = jax.default_backend()
    skips = {}
    if backend != "gpu":
        skips["gpu"] = pytest.mark.skip(reason="needs JAX on a GPU (compiled Pallas kernels)")
    if backend != "cpu":
        skips["cpu"] = pytest.mark.skip(reason=f"checks XLA:CPU's behaviour; JAX runs on "
                                               f"{backend}")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


def backend_compiles(fn) -> list:
    """The XLA compilations ``fn()`` triggers (jax.monitoring's public event listener)."""
    events = []
    listener = lambda event, *a, **k: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return [e for e in events if "backend_compile" in e]


def piped_chat_order(monkeypatch, argv: list, questions: str) -> list:
    """``jaxllm`` run with ``argv`` and ``questions`` piped in: the order of its compiles of the
    answer's program ("steps", jax.monitoring's events) and its reads of weights from a model
    directory ("read", jaxllm.io._read_placed)."""
    import io

    from jaxllm import io as jio
    from jaxllm.cli import main
    seen, read = [], jio._read_placed
    monkeypatch.setattr(jio, "_read_placed", lambda *a: seen.append("read") or read(*a))

    def on(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and \
                "steps" in str(kw.get("fun_name")):
            seen.append("steps")
    monkeypatch.setattr("sys.stdin", io.StringIO(questions))
    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        assert main(argv) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
    return seen
