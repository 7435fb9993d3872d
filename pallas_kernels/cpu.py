"""Hand-written CPU kernels for decoding, as XLA FFI custom calls: the int8 x int8 -> int32
product of a few rows for W8A8 (``csrc/int8_rows.cc``), the 4- and 8-bit weight-only products
(``csrc/lowbit_rows.cc``), the float and int8 weight-only ones (``csrc/float_rows.cc``), and a
decode step's attention against the whole KV cache (``csrc/decode_attention.cc``).

Why: XLA:CPU hands a few-row int8 product to YNNPACK, which at 8 rows does about 50 G
multiply-adds a second on a 2-core machine, so a W8A8 decode step at batch 8 spent more time in
its int8 products than float32 spends reading its 4x larger weights (docs/BENCHMARKS.md,
roofline). The kernel reads each weight row once for all the rows, multiplies with AVX-512 VNNI
(64 multiply-adds an instruction) and splits the output rows over XLA's intra-op threads. Its
sums are exact, so it returns what XLA's dot returns, bit for bit.

Why the attention kernel: XLA:CPU scores the query's rows against the keys with YNNPACK and
weights the values with a second product, reading a float32 cache at 6-15 GB/s on this machine
and a 2-byte cache only after widening it into float32 copies. The kernel reads each head's keys
and values once, widens 2-byte ones in registers, and scores each slot against the one query
rotation it needs (docs/BENCHMARKS.md, "KV cache passes").

The kernels are built on first use with the machine's C++ compiler (``$CXX``, else ``c++``) and
``-march=native``, against the FFI headers that jaxlib ships, into one library cached
(``$JAXLLM_CACHE_DIR``, else ``~/.cache/jaxllm``) under a key of the sources, the flags, the
compiler, jaxlib's version and the CPU. They are used only on x86-64 CPUs: the int8 one with
AVX-512 VNNI (for up to ``FEW_ROWS`` rows), the attention and float ones with AVX-512 or AVX2,
the low-bit one with AVX2: elsewhere, or when they cannot be built (a warning
says why), XLA computes as before. ``JAXLLM_CPU_KERNELS=0`` turns them off (no build).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
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
import numpy as np
from jaxtyping import Array, Float, Int, Int8

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "int8_rows.cc", CSRC / "decode_attention.cc", CSRC / "lowbit_rows.cc",
           CSRC / "float_rows.cc")
HEADERS = (CSRC / "blocks.h",)
TARGET = "jaxllm_int8_rows"
TOKEN_TARGET = "jaxllm_int8_rows_token"
ATTENTION_TARGET = "jaxllm_decode_attention"
LOWBIT_TARGET = "jaxllm_lowbit_rows"
FLOAT_TARGET = "jaxllm_float_rows"
# The weights the float kernel reads (jaxllm.quant.decode_weights' and W8's).
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8)
# What the attention kernel reads: these cache dtypes (uint16: bfloat16's bits), head dims up to
# MAX_HEAD_DIM (a query head's weighted value sums then fit in 16 vector registers, so each value
# row is read once; csrc/decode_attention.cc checks the same bound).
ATTENTION_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.uint16)
MAX_HEAD_DIM = 256
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# Decode's rows (jaxllm.quant.MANY_ROWS). Pythia-160M's 49 int8 products chained, against XLA's
# (YNNPACK): 1.4x at 1 row, 1.7-2.2x at 2-8, 1.4x at 64 (docs/BENCHMARKS.md, "INT8 rows"); past
# that a prefill's many rows keep XLA's GEMM, which is made for them (the kernel called directly
# was level with it at 128-256 rows in a scratch run).
FEW_ROWS = 64
# Rows up to which the 4-bit kernel multiplies (each row costs it one FMA per weight, against a
# GEMM's blocked reuse; a decode step has a row per sequence).
FEW_ROWS_LOWBIT = 16
# Rows up to which the float kernel multiplies, in one pass over the weights: past them XLA's
# row reduction was as fast or faster (4 rows; 2 for inputs wider than WIDE_INPUT columns:
# Llama-7B's MLP at 4 rows took the kernel 1.2x XLA's time; docs/CPU.md, "Float products").
FEW_ROWS_FLOAT = 4
WIDE_INPUT = 3072
FEW_ROWS_FLOAT_WIDE = 2
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


def build(cxx: Optional[str] = None, out_dir: Optional[Path] = None,
          sources: tuple = SOURCES, extra_flags: tuple = ()) -> Path:
    """The kernels' shared library, compiled now unless a cached one has the same key; written
    atomically (a temporary file renamed into place), so concurrent builds do not collide.
    ``sources`` and ``extra_flags`` (after -march=native) build another library: a test builds
    the AVX2 paths on a machine with AVX-512 (``-mno-avx512f``)."""
    flags = (*FLAGS, *extra_flags)
    cxx = cxx or os.environ.get("CXX") or "c++"
    exe = shutil.which(cxx)
    if exe is None:
        raise CPUKernelError(f"no C++ compiler {cxx!r} on PATH (set $CXX, or "
                             f"JAXLLM_CPU_KERNELS=0 to use XLA without trying)")
    include = jax.ffi.include_dir()
    texts = [f.read_text() for f in (*sources, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), exe, jax.__version__,
                                    _jaxlib_version(), _cpu_id()]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir or cache_dir())
    lib = out_dir / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-partial-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [exe, *flags, "-isystem", include, *map(str, sources), "-o", tmp]
    log.info("jaxllm: building the CPU kernels: %s", " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise CPUKernelError(f"building the CPU kernels failed ({' '.join(cmd)}):\n"
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
    """(the loaded library, "") when the kernels can be used here, else (None, why not). Built
    and registered with XLA once per process.

    The kernels are registered for XLA:CPU alone, so they serve only a process whose default
    backend is the CPU: with a GPU or TPU present every use_* answer is False and no array is
    routed to them (and where one asks anyway, :func:`on_cpu` compiles the XLA branch for any
    other platform)."""
    if not enabled():
        return None, "turned off by JAXLLM_CPU_KERNELS=0"
    if jax.default_backend() != "cpu":
        return None, (f"JAX computes on {jax.default_backend()} here; the kernels serve XLA:CPU "
                      f"only")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no kernels for {platform.machine()} (they are written for x86-64)"
    if not hasattr(jax, "ffi"):
        return None, f"jax {jax.__version__} has no jax.ffi (0.4.38 or later has)"
    try:
        lib = ctypes.CDLL(str(build()))
    except (CPUKernelError, OSError) as e:
        warnings.warn(f"jaxllm: the CPU kernels are not available, decoding uses XLA's "
                      f"products (slower at a few rows): {e}", RuntimeWarning, stacklevel=3)
        return None, str(e)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxllmInt8Rows), platform="cpu")
    jax.ffi.register_ffi_target(TOKEN_TARGET, jax.ffi.pycapsule(lib.JaxllmInt8RowsToken),
                                platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.JaxllmDecodeAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target(LOWBIT_TARGET, jax.ffi.pycapsule(lib.JaxllmLowbitRows),
                                platform="cpu")
    jax.ffi.register_ffi_target(FLOAT_TARGET, jax.ffi.pycapsule(lib.JaxllmFloatRows),
                                platform="cpu")
    return lib, ""


def _why_not_int8() -> str:
    lib, why = _library()
    if lib is not None and not lib.jaxllm_int8_rows_vnni():
        return "this CPU has no AVX-512 VNNI: XLA's int8 dot is the faster one here"
    return why


def _why_not_attention() -> str:
    lib, why = _library()
    if lib is not None and not lib.jaxllm_decode_attention_isa():
        return "this CPU has neither AVX-512 (F, BW, VL) nor AVX2 with FMA: the jnp path is used"
    return why


def attention_isa() -> str:
    """The instructions the decode-attention kernel uses here (AVX-512 where the CPU has it)."""
    lib, _ = _library()
    return "AVX-512" if lib is not None and lib.jaxllm_decode_attention_isa() == 512 else "AVX2"


def _why_not_lowbit() -> str:
    lib, why = _library()
    if lib is not None and not lib.jaxllm_lowbit_rows_avx2():
        return "this CPU has no AVX2 with FMA and F16C: XLA's form is used"
    return why


def _why_not_float() -> str:
    lib, why = _library()
    if lib is not None and not lib.jaxllm_float_rows_isa():
        return "this CPU has neither AVX-512 (F, BW) nor AVX2 with FMA and F16C: XLA's is used"
    return why


def float_isa() -> str:
    """The instructions the float kernel uses here (AVX-512 where the CPU has it)."""
    lib, _ = _library()
    return "AVX-512" if lib is not None and lib.jaxllm_float_rows_isa() == 512 else "AVX2"


def status() -> str:
    """Whether decode's few-row int8 (W8A8), 4- and 8-bit and float (weight-only) products and
    its attention use the kernels on this machine, and if not why: four lines."""
    why8, whya, why4, whyf = (_why_not_int8(), _why_not_attention(), _why_not_lowbit(),
                              _why_not_float())
    return "\n".join([
        "int8 rows: AVX-512 VNNI kernel" if not why8 else f"int8 rows: XLA ({why8})",
        "4- and 8-bit rows: AVX2 kernel" if not why4 else f"4- and 8-bit rows: XLA ({why4})",
        f"float rows: {float_isa()} kernel" if not whyf else f"float rows: XLA ({whyf})",
        f"decode attention: {attention_isa()} kernel" if not whya else
        f"decode attention: XLA ({whya})"])


def status_line(kernel: str) -> str:
    """The line of :func:`status` for ``kernel``: "int8 rows", "4- and 8-bit rows", "float rows"
    or "decode attention"."""
    return next(x for x in status().splitlines() if x.startswith(kernel + ":"))


def available() -> bool:
    """The int8 kernel is built, loaded and registered, and this CPU runs it (VNNI)."""
    return not _why_not_int8()


def attention_available() -> bool:
    """The decode-attention kernel is built, loaded and registered, and this CPU runs it."""
    return not _why_not_attention()


def lowbit_available() -> bool:
    """The low-bit kernel is built, loaded and registered, and this CPU runs it (AVX2)."""
    return not _why_not_lowbit()


def lowbit_use_for(m: int, bits: int, group: int) -> bool:
    """Whether a ``bits``-bit product of ``m`` rows goes to the low-bit kernel (CPU backend):
    4- or 8-bit codes in groups of whole words, decode's few rows (a prefill's many keep XLA's
    GEMM over the dequantized weight, which is made for them)."""
    return (0 < m <= FEW_ROWS_LOWBIT and bits in (4, 8) and group % 8 == 0
            and lowbit_available())


def float_available() -> bool:
    """The float kernel is built, loaded and registered, and this CPU runs it (AVX-512 or AVX2)."""
    return not _why_not_float()


def float_use_for(m: int, k: int, dtype) -> bool:
    """Whether a weight-only product of ``m`` rows of length ``k`` with a ``dtype`` weight goes
    to the float kernel (CPU backend): decode's few rows (more keep XLA's forms)."""
    few = FEW_ROWS_FLOAT if k <= WIDE_INPUT else FEW_ROWS_FLOAT_WIDE
    return (0 < m <= few and jnp.dtype(dtype) in map(jnp.dtype, FLOAT_DTYPES)
            and float_available())


def use_for(m: int, k: int) -> bool:
    """Whether an int8 product of ``m`` rows of length ``k`` goes to the kernel (CPU backend)."""
    return 0 < m <= FEW_ROWS and 0 < k < MAX_K and available()


def on_cpu(kernel, fallback, *args):
    """``kernel(*args)`` in a program compiled for the CPU, ``fallback(*args)`` (the same
    numbers by XLA) in one compiled for any other platform. The choice is made when the program
    is lowered (``lax.platform_dependent``), not when it is traced: a function traced in a
    CPU-default process but placed on a GPU (committed arrays, ``lowering_platforms``) never
    reaches the CPU-only FFI targets."""
    return jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)


def _check_rows(name: str, x: Array, w: Array, x_dtype) -> None:
    """The int8 kernels' arguments: ``x`` [M, K] of ``x_dtype`` and int8 ``w`` [N, K], K below
    MAX_K, and the kernel available here."""
    if not available():
        raise CPUKernelError(f"the int8 CPU kernel is not available: {_why_not_int8()}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name} needs x [M, K] and w [N, K] with the same K; got {x.shape} "
                         f"and {w.shape}")
    if x.dtype != x_dtype or w.dtype != jnp.int8:
        raise ValueError(f"{name} takes {jnp.dtype(x_dtype).name} x and int8 w, got {x.dtype} "
                         f"and {w.dtype}")
    if x.shape[1] >= MAX_K:
        raise ValueError(f"{name} needs K < {MAX_K}, got {x.shape[1]}")


def int8_rows(x: Int8[Array, "m k"], w: Int8[Array, "n k"]) -> Int[Array, "m n"]:
    """x @ wᵀ, int8 x int8 -> int32 exactly, by the kernel (``w`` K-major [N, K])."""
    _check_rows("int8_rows", x, w, jnp.int8)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


def int8_rows_token(x: Float[Array, "m k"], w: Int8[Array, "n k"]
                    ) -> tuple[Int[Array, "m n"], Float[Array, " m"]]:
    """(acc, sx): each row of float32 ``x`` quantized to int8 with its own absmax scale sx[m]
    (as ``reference.quantize_per_token`` does under jit, to the bit), and acc = that int8
    x @ wᵀ in int32 (exact), in one kernel call."""
    _check_rows("int8_rows_token", x, w, jnp.float32)
    out = (jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32),
           jax.ShapeDtypeStruct((x.shape[0],), jnp.float32))
    return jax.ffi.ffi_call(TOKEN_TARGET, out, vmap_method="sequential")(x, w)


def lowbit_rows(x: Float[Array, "m k"], codes: Array, scale: Array, offset: Array, bits: int,
                group: int, int8_x: bool = False) -> Float[Array, "m n"]:
    """x @ ŵᵀ by the kernel (``csrc/lowbit_rows.cc``) for 4-bit codes [N, ceil(K / 8)] uint32
    (jaxllm.lowbit's packing) or 8-bit ones [N, K] uint8, with per-group ``scale`` and
    ``offset`` [N, ceil(K / group)] (float32 or float16); float32 sums. ``int8_x`` (group a
    multiple of 32): x rounded to 8 bits per 32 columns first
    (jaxllm.lowbit.round_blocks, to the bit) and the codes multiplied as integers."""
    if not lowbit_available():
        raise CPUKernelError(f"the low-bit CPU kernel is not available: {_why_not_lowbit()}")
    M, K = x.shape
    N = codes.shape[0]
    groups = -(-K // group)
    want = ((N, -(-K // 8)), jnp.uint32) if bits == 4 else ((N, K), jnp.uint8)
    if (bits not in (4, 8) or codes.shape != want[0] or codes.dtype != want[1] or group % 8
            or scale.shape != (N, groups) or offset.shape != (N, groups)
            or scale.dtype != offset.dtype or scale.dtype not in (jnp.float32, jnp.float16)):
        raise ValueError(f"lowbit_rows needs x [M, K], 4-bit codes [N, ceil(K/8)] uint32 or "
                         f"8-bit [N, K] uint8, scale and offset [N, ceil(K/group)] of one float "
                         f"dtype, group a multiple of 8; got x {x.shape}, {bits}-bit codes "
                         f"{codes.shape} {codes.dtype}, scale {scale.shape} {scale.dtype}, "
                         f"offset {offset.shape} {offset.dtype}, group {group}")
    if int8_x and group % 32:
        raise ValueError(f"lowbit_rows rounds x to 8 bits (int8_x) for codes in groups of a "
                         f"multiple of 32 columns; got group {group}")
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    return jax.ffi.ffi_call(LOWBIT_TARGET, out, vmap_method="sequential")(
        x.astype(jnp.float32), codes, scale, offset, bits=np.int64(bits), group=np.int64(group),
        int8_x=bool(int8_x))


def float_rows(x: Float[Array, "m k"], w: Array) -> Float[Array, "m n"]:
    """x @ wᵀ by the kernel (``csrc/float_rows.cc``) for a weight ``w`` [N, K] in float32,
    bfloat16, float16 or int8 (its codes; a scale is the caller's): float32 sums."""
    if not float_available():
        raise CPUKernelError(f"the float CPU kernel is not available: {_why_not_float()}")
    if (x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]
            or jnp.dtype(w.dtype) not in map(jnp.dtype, FLOAT_DTYPES)):
        raise ValueError(f"float_rows needs x [M, K] and w [N, K] (float32, bfloat16, float16 "
                         f"or int8) with the same K; got x {x.shape}, w {w.shape} {w.dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(FLOAT_TARGET, out, vmap_method="sequential")(
        x.astype(jnp.float32), w)


def decode_attention(k: Array, v: Array, q: Float[Array, "n rg d"], pick: Int[Array, "b c"],
                     groups: int, *, dist: Optional[Int[Array, "b c"]] = None,
                     slopes: Optional[Float[Array, "n g"]] = None,
                     zero_sink: bool = False) -> Float[Array, "n g d"]:
    """One decode step's attention by the kernel (``csrc/decode_attention.cc``): for head row
    ``n`` of ``k``, ``v`` [N, C, D] (float32, float16, bfloat16 or its uint16 bits; N = B * KVH,
    row n in batch n // KVH), each slot ``c`` is scored against the ``groups`` query rows
    ``pick[b, c] * groups + g`` of ``q`` [N, R * groups, D] (``pick`` < 0: masked), divided by
    sqrt(D), less ``slopes[n, g] * dist[b, c]`` when ALiBi; softmax over the slots (with one
    zero score of value 0 when ``zero_sink``); the values weighted by it -> [N, groups, D]."""
    if not attention_available():
        raise CPUKernelError(f"the decode-attention CPU kernel is not available: "
                             f"{_why_not_attention()}")
    N, C, D = k.shape
    B = pick.shape[0]
    if (v.shape != k.shape or v.dtype != k.dtype or q.ndim != 3 or q.shape[0] != N
            or q.shape[2] != D or q.shape[1] % groups or pick.shape != (B, C) or N % B):
        raise ValueError(f"decode_attention needs k, v [N, C, D], q [N, R*G, D] and pick [B, C] "
                         f"with N a multiple of B; got k {k.shape} {k.dtype}, v {v.shape} "
                         f"{v.dtype}, q {q.shape}, pick {pick.shape}, groups {groups}")
    if k.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"decode_attention reads float32, float16 or bfloat16 caches (or "
                         f"bfloat16's uint16 bits), not {k.dtype}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"decode_attention handles head dims up to {MAX_HEAD_DIM}, got {D}")
    alibi = dist is not None
    dist = jnp.zeros((B, C), jnp.int32) if dist is None else dist.astype(jnp.int32)
    slopes = (jnp.zeros((N, groups), jnp.float32) if slopes is None
              else jnp.broadcast_to(slopes, (N, groups)).astype(jnp.float32))
    out = jax.ShapeDtypeStruct((N, groups, D), jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_TARGET, out, vmap_method="sequential")(
        k, v, q.astype(jnp.float32), pick.astype(jnp.int32), dist, slopes,
        root_d=np.float32(math.sqrt(D)), alibi=alibi, zero_sink=zero_sink)
