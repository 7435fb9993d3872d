"""The GGUF container: header, metadata and tensor directory, read in bounded work.

GGUF (llama.cpp's ``docs/gguf.md``, versions 2 and 3, little-endian): the magic ``GGUF``, a
uint32 version, uint64 tensor and metadata counts, the metadata (key, uint32 type, value; strings
are a uint64 length and UTF-8 bytes; arrays a uint32 element type, a uint64 count and the
elements), the tensor directory (name, uint32 dimension count, uint64 dimensions fastest first,
uint32 ggml type, uint64 offset into the data) and the data, aligned to ``general.alignment``
(32 by default).

Read here rather than with the ``gguf`` package's ``GGUFReader``, which builds a numpy view per
metadata element: a tokenizer's 49,152 strings and 48,900 merges took SmolLM2's load 10 s of CPU
for each reader. Every count and length is checked against the bytes left before anything is
allocated, so a file that lies about its sizes is refused in one line, in time proportional to
its size. The tensors' data is memory-mapped, not read: a tensor's bytes are paged in when used.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# ggml type id -> (name, elements per block, bytes per block) of the types whose size we know
# (llama.cpp's ggml.h / gguf's GGML_QUANT_SIZES); a tensor of any other type is refused when read.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
              6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
              9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
              12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
              27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2)}
# metadata value type -> struct format of its scalars (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays (none in llama.cpp's files; one level allowed)


class GGUFError(ValueError):
    """A file that is not a readable GGUF file, named with what is wrong."""


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: str  # the ggml type's name (F32, Q4_1, ...), or "type N" for one not known here
    shape: tuple[int, ...]  # numpy order (slowest first)
    offset: int  # bytes from the file's start
    n_bytes: int  # 0 where the type's size is not known
    _buffer: Any

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, uint8 [n_bytes], mapped from the file (read-only)."""
        if not self.n_bytes:
            raise GGUFError(f"tensor {self.name} is of GGUF {self.kind}, whose size is not known "
                            f"here")
        return np.frombuffer(self._buffer, np.uint8, self.n_bytes, self.offset)


class GGUFFile:
    """``fields``: metadata key -> value (int, float, bool, str, or a list of them);
    ``tensors``: name -> :class:`Tensor`, in the file's order."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise GGUFError(f"{path} is empty, not a GGUF file")
            self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        self._size = size
        try:
            self._read()
        except struct.error:  # a read past the end that the checks did not foresee
            raise GGUFError(f"{path}: not a readable GGUF file (it ends inside its header)") \
                from None

    # -- the header ---------------------------------------------------------------------------
    def _read(self) -> None:
        if self._take(4) != b"GGUF":
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version = self._unpack("<I")
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            raise GGUFError(f"{self.path}: not a readable GGUF file (" + (
                "big-endian; convert it with llama.cpp's gguf tools" if swapped in (2, 3) else
                f"version {version}; jaxllm reads versions 2 and 3") + ")")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        # each directory entry takes at least 24 bytes and each field at least 13
        self._bound(n_tensors, 24, "tensor count")
        self._bound(n_fields, 13, "metadata count")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string("a metadata key")
            if key in self.fields:
                raise GGUFError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._unpack("<I"), key, 0)
        infos = []
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            n_dims = self._unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions "
                                f"(GGUF allows 1 to {MAX_DIMS})")
            dims = [self._unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or not 1 <= align <= 1 << 16 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment {align!r} is not a power of two "
                            f"up to 65536")
        start = -(-self._pos // align) * align
        self.tensors: dict[str, Tensor] = {}
        for name, dims, type_id, offset in infos:
            self.tensors[name] = self._tensor(name, dims, type_id, offset, start, align)

    def _tensor(self, name, dims, type_id, offset, start, align) -> Tensor:
        if name in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name} appears twice")
        count = 1
        for d in dims:
            if d < 1:
                raise GGUFError(f"{self.path}: tensor {name} has a dimension of {d}")
            count *= d
        kind, block, nbytes = GGML_TYPES.get(type_id, (f"type {type_id}", 0, 0))
        if block:
            if dims[0] % block:
                raise GGUFError(f"{self.path}: tensor {name}'s rows of {dims[0]} are not whole "
                                f"{kind} blocks of {block}")
            nbytes = count // block * nbytes
        if offset % align or start + offset + nbytes > self._size:
            raise GGUFError(f"{self.path}: not a readable GGUF file (tensor {name}'s data, "
                            f"{nbytes:,} bytes at {offset:,}, lies outside the file of "
                            f"{self._size:,} bytes or off its {align}-byte alignment)")
        return Tensor(name, kind, tuple(reversed(dims)), start + offset, nbytes, self._buffer)

    # -- values -------------------------------------------------------------------------------
    def _value(self, kind: int, key: str, depth: int):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == 8:
            return self._string(key)
        if kind != 9 or depth >= MAX_NESTING:
            raise GGUFError(f"{self.path}: metadata {key!r} has value type {kind}, which GGUF "
                            f"does not define" if kind != 9 else
                            f"{self.path}: metadata {key!r} nests arrays too deeply")
        item, n = self._unpack("<I"), self._unpack("<Q")
        if item in _SCALARS:
            width = struct.calcsize(_SCALARS[item])
            self._bound(n, width, f"{key!r}'s length")
            out = np.frombuffer(self._take(n * width), _NUMPY[item])
            return (out.astype(bool) if item == 7 else out).tolist()
        self._bound(n, 8, f"{key!r}'s length")  # a string or an array takes 8 bytes at least
        if item == 8:
            return self._strings(n, key)
        return [self._value(item, key, depth + 1) for _ in range(n)]

    def _string(self, what: str) -> str:
        n = self._unpack("<Q")
        self._bound(n, 1, f"the length of {what}")
        raw = self._take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8") from None

    def _strings(self, n: int, key: str) -> list[str]:
        """``n`` strings in a row (a tokenizer's vocabulary and merges: the hot loop of a load)."""
        buf, pos, size, length = self._buffer, self._pos, self._size, _STRUCT_Q.unpack_from
        out = []
        try:
            for _ in range(n):
                k, = length(buf, pos)
                pos += 8
                if pos + k > size:
                    raise GGUFError(f"{self.path}: not a readable GGUF file ({key!r} runs past "
                                    f"its end)")
                out.append(buf[pos:pos + k].decode("utf-8"))
                pos += k
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: an element of {key!r} is not valid UTF-8") from None
        self._pos = pos
        return out

    # -- bytes --------------------------------------------------------------------------------
    def _bound(self, count: int, each: int, what: str) -> None:
        left = self._size - self._pos
        if count * each > left:
            raise GGUFError(f"{self.path}: not a readable GGUF file (its {what}, {count:,}, "
                            f"needs more than the {left:,} bytes left)")

    def _take(self, n: int) -> bytes:
        if self._pos + n > self._size:
            raise struct.error("past the end")
        out = self._buffer[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str):
        s = _STRUCTS.get(fmt) or _STRUCTS.setdefault(fmt, struct.Struct(fmt))
        v, = s.unpack_from(self._buffer, self._pos)
        self._pos += s.size
        return v


_STRUCTS: dict = {}
_STRUCT_Q = struct.Struct("<Q")
