"""What a run says while it works: compile time kept apart from run time, progress bars whose
rate and ETA leave compilation out, and the persistent XLA compilation cache.

JAX reports every trace, lowering and backend compile through ``jax.monitoring`` (with the
program's name); :func:`watch_compiles` listens to those events, so timing, bars and messages
need no hooks in the code that compiles.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Optional

import jax

# jax.monitoring's duration events of one compilation, in the order they fire.
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILED = "/jax/core/compile/backend_compile_duration"
_STAGES = ("/jax/core/compile/jaxpr_trace_duration", _LOWERED, _COMPILED)
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

# Programs this quick to lower and compile are not announced (element-wise helpers, casts).
ANNOUNCE_LOWERING_S = 0.2
REPORT_COMPILE_S = 0.5
# Compiles in a thread of this name are not announced: work done ahead in the background
# (jaxllm.chat.Chat.warm_up, while the user types), whose lines would break into the prompt.
QUIET_THREAD = "jaxllm-background"


def _name(kw: dict) -> str:
    name = kw.get("fun_name", "a program")
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name


@contextlib.contextmanager
def watch_compiles(echo: Optional[Callable[[str], None]] = None):
    """Yields a list whose one number is the seconds JAX spent tracing, lowering and compiling
    inside the block (so a rate can leave them out). ``echo``: called with a line when a large
    program starts compiling and when it is done (or came from the compilation cache)."""
    spent = [0.0]
    state = {"announced": set(), "hit": False}

    def on_duration(event, secs, **kw):
        if event not in _STAGES:
            return
        spent[0] += secs
        if echo is None or threading.current_thread().name == QUIET_THREAD:
            return
        name = _name(kw)
        if event == _LOWERED and secs >= ANNOUNCE_LOWERING_S:
            state["announced"].add(name)
            echo(f"compiling {name} ...")
        elif event == _COMPILED and (name in state["announced"] or secs >= REPORT_COMPILE_S):
            state["announced"].discard(name)
            how = "from the compilation cache" if state["hit"] else "compiled"
            echo(f"{name}: {how} in {secs:.1f} s")
            state["hit"] = False

    def on_event(event, **kw):
        if event == _CACHE_HIT:
            state["hit"] = True

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield spent
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


@contextlib.contextmanager
def bar(**kwargs):
    """A tqdm progress bar (``kwargs``) whose rate and ETA leave compilation out: the time each
    compile takes while it is open is added to its start, as if its clock had stopped."""
    from tqdm.auto import tqdm
    b = tqdm(**kwargs)

    def on_duration(event, secs, **kw):
        if event in _STAGES and not b.disable:  # a disabled bar keeps no clock
            b.start_t += secs
            b.last_print_t += secs

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield b
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        b.close()


def say(line: str) -> None:
    """One status line on stderr, above any progress bar, when stderr is a terminal (as git
    shows its progress): a log or a script reading stderr gets only results, warnings and
    one-line errors."""
    if not sys.stderr.isatty():
        return
    from tqdm.auto import tqdm
    tqdm.write(line, file=sys.stderr)


@contextlib.contextmanager
def timed(what: str, echo: Callable[[str], None] = say):
    """``echo`` "WHAT ..." before the block and "WHAT: done in S s" after it."""
    echo(f"{what} ...")
    t0 = time.perf_counter()
    yield
    echo(f"{what}: done in {time.perf_counter() - t0:.1f} s")


def return_freed_memory() -> None:
    """Give the heap memory this process has freed back to the system (glibc's
    ``malloc_trim``; nothing elsewhere). Compiling a program, or loading one from the cache,
    frees a few hundred MiB that glibc otherwise keeps resident (docs/CPU.md, "Peak
    memory")."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def one_malloc_arena() -> None:
    """Have glibc serve every thread started from now on from one heap (``M_ARENA_MAX`` 1;
    nothing elsewhere). By default each thread that allocates gets an arena of its own, and
    the freed memory scattered over them stays resident between the trims: a chat's peak 10
    MiB higher, its speed the same (docs/CPU.md, "Peak memory")."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX, malloc.h
    except (OSError, AttributeError):  # not glibc
        pass


@contextlib.contextmanager
def trimming_after_compiles():
    """Within the block, :func:`return_freed_memory` after each program compiles (or comes from
    the compilation cache): a chat or a server keeps its resident memory to what it uses."""
    def on_duration(event, secs, **kw):
        if event == _COMPILED and secs >= REPORT_COMPILE_S:
            return_freed_memory()
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)


def default_cache_dir() -> str:
    """Where the CLI keeps compiled programs: $JAXLLM_CACHE_DIR/xla, else
    $XDG_CACHE_HOME/jaxllm/xla, else ~/.cache/jaxllm/xla."""
    root = os.environ.get("JAXLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "jaxllm")
    return os.path.join(root, "xla")


def use_compile_cache(path: str) -> bool:
    """Keep compiled programs in ``path`` across runs (JAX's persistent compilation cache),
    unless a cache directory is set already (JAX_COMPILATION_CACHE_DIR, or by the caller).
    Every program is kept, however fast it compiled: the chat's prompt runs a dozen small ones,
    which a threshold left to compile again in every run (docs/CPU.md, "A layer at a time").
    False if ``path`` cannot be made (the run goes on without the cache)."""
    if jax.config.jax_compilation_cache_dir:
        return True
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return True
