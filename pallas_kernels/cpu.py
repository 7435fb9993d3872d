"""A hand-written CPU kernel for W8A8 decoding: the int8 x int8 -> int32 product of a few rows
(``csrc/int8_rows.cc``), as an XLA FFI custom call.

Why: XLA:CPU hands a few-row int8 product to YNNPACK, which at 8 rows does about 50 G
multiply-adds a second on a 2-core machine, so a W8A8 decode step at batch 8 spent more time in
its int8 products than float32 spends reading its 4x larger weights (docs/BENCHMARKS.md,
roofline). The kernel reads each weight row once for all the rows, multiplies with AVX-512 VNNI
(64 multiply-adds an instruction) and splits the output rows over XLA's intra-op threads. Its
sums are exact, so it returns what XLA's dot returns, bit for bit.

The kernel is built on first use with the machine's C++ compiler (``$CXX``, else ``c++``) and
``-march=native``, against the FFI headers that jaxlib ships, and cached (``$JAXLLM_CACHE_DIR``,
else ``~/.cache/jaxllm``) under a key of the source, the flags, the compiler, jaxlib's version
and the CPU. It is used only on x86-64 CPUs with VNNI, for up to ``FEW_ROWS`` rows: elsewhere, or
when it cannot be built (a warning says why), products go to XLA as before.
``JAXLLM_CPU_KERNELS=0`` turns it off (no build).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Int8

SOURCE = Path(__file__).with_name("csrc") / "int8_rows.cc"
TARGET = "jaxllm_int8_rows"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# Decode's rows (jaxllm.quant.MANY_ROWS). Pythia-160M's 49 int8 products chained, against XLA's
# (YNNPACK): 1.4x at 1 row, 1.7-2.2x at 2-8, 1.4x at 64 (docs/BENCHMARKS.md, "INT8 rows"); past
# that a prefill's many rows keep XLA's GEMM, which is made for them (the kernel called directly
# was level with it at 128-256 rows in a scratch run).
FEW_ROWS = 64
# The kernel's int32 partial sums of (x + 128) * w are exact below this K.
MAX_K = 65536

log = logging.getLogger("jaxllm")


class CPUKernelError(RuntimeError):
    """The CPU kernel could not be built or loaded; the message says why and what to do."""


def enabled() -> bool:
    """False when ``$JAXLLM_CPU_KERNELS`` is 0/off/false/no."""
    return os.environ.get("JAXLLM_CPU_KERNELS", "1").strip().lower() not in ("0", "off", "false",
                                                                               "no")


def cache_dir() -> Path:
    """``$JAXLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxllm``, else ``~/.cache/jaxllm``."""
    if os.environ.get("JAXLLM_CACHE_DIR"):
        return Path(os.environ["JAXLLM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxllm"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), or the
    platform's processor string."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
        return "\n".join(dict.fromkeys(keep)) or platform.processor()
    except OSError:
        return platform.processor()


def build(cxx: Optional[str] = None, out_dir: Optional[Path] = None) -> Path:
    """The kernel's shared library, compiled now unless a cached one has the same key; written
    atomically (a temporary file renamed into place), so concurrent builds do not collide."""
    cxx = cxx or os.environ.get("CXX") or "c++"
    exe = shutil.which(cxx)
    if exe is None:
        raise CPUKernelError(f"no C++ compiler {cxx!r} on PATH (set $CXX, or "
                             f"JAXLLM_CPU_KERNELS=0 to use XLA's int8 dot without trying)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), exe, jax.__version__,
                                    _jaxlib_version(), _cpu_id()]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir or cache_dir())
    lib = out_dir / f"int8_rows-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".int8_rows-partial-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [exe, *FLAGS, "-isystem", include, str(SOURCE), "-o", tmp]
    log.info("jaxllm: building the int8 CPU kernel: %s", " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise CPUKernelError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n"
                                 f"{res.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _jaxlib_version() -> str:
    import jaxlib
    return getattr(jaxlib, "__version__", "")


@functools.cache
def _library() -> tuple[Optional[ctypes.CDLL], str]:
    """(the loaded library, "") when the kernel is usable here, else (None, why not). Built and
    registered with XLA once per process."""
    if not enabled():
        return None, "turned off by JAXLLM_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no kernel for {platform.machine()} (AVX-512 VNNI is x86-64)"
    if not hasattr(jax, "ffi"):
        return None, f"jax {jax.__version__} has no jax.ffi (0.4.38 or later has)"
    try:
        lib = ctypes.CDLL(str(build()))
    except (CPUKernelError, OSError) as e:
        warnings.warn(f"jaxllm: the int8 CPU kernel is not available, W8A8 decode uses XLA's "
                      f"int8 dot (slower at a few rows): {e}", RuntimeWarning, stacklevel=3)
        return None, str(e)
    if not lib.jaxllm_int8_rows_vnni():
        return None, "this CPU has no AVX-512 VNNI: XLA's int8 dot is the faster one here"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxllmInt8Rows), platform="cpu")
    return lib, ""


def status() -> str:
    """One line: whether few-row int8 products on this machine use the kernel, and if not why."""
    lib, why = _library()
    return "int8 rows: AVX-512 VNNI kernel" if lib is not None else f"int8 rows: XLA ({why})"


def available() -> bool:
    """The kernel is built, loaded and registered, and this CPU runs it (VNNI)."""
    return _library()[0] is not None


def use_for(m: int, k: int) -> bool:
    """Whether an int8 product of ``m`` rows of length ``k`` goes to the kernel (CPU backend)."""
    return (jax.default_backend() == "cpu" and 0 < m <= FEW_ROWS and 0 < k < MAX_K
            and available())


def int8_rows(x: Int8[Array, "m k"], w: Int8[Array, "n k"]) -> Int[Array, "m n"]:
    """x @ wᵀ, int8 x int8 -> int32 exactly, by the kernel (``w`` K-major [N, K])."""
    if not available():
        raise CPUKernelError(f"the int8 CPU kernel is not available: {_library()[1]}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"int8_rows needs x [M, K] and w [N, K] with the same K; got {x.shape} "
                         f"and {w.shape}")
    if x.dtype != jnp.int8 or w.dtype != jnp.int8:
        raise ValueError(f"int8_rows takes int8 x and w, got {x.dtype} and {w.dtype}")
    if x.shape[1] >= MAX_K:
        raise ValueError(f"int8_rows needs K < {MAX_K}, got {x.shape[1]}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)
