"""The embedded texts: English about code from the documentation that ships with Python, and
English prose from a public-domain novel that ships with jaxllm.

The embedded corpus is built from ``pydoc_data.topics`` (the language reference topics behind
``help()``) and the docstrings of a fixed list of standard-library modules, in a fixed order:
deterministic for a given Python version, ~750 KB, no download.

The prose is Lewis Carroll's *Alice's Adventures in Wonderland* (1865; public domain), the
Millennium Fulcrum Edition 3.0 text, in ``data/alice.txt``. Chapters I-IX calibrate (mixed
with as much of the embedded corpus: :func:`calibration_corpus`); chapters X-XII are never
calibrated on, so they measure what calibration does to prose it has not seen
(``benchmarks/calibration.py``).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import os
import subprocess
import sys
import warnings

MODULES = (
    "builtins", "os", "sys", "collections", "itertools", "functools", "re", "json", "math",
    "string", "pathlib", "typing", "dataclasses", "inspect", "io", "shutil", "subprocess",
    "threading", "asyncio", "unittest", "logging", "argparse", "datetime", "random", "statistics",
    "decimal", "fractions", "heapq", "bisect", "operator", "contextlib", "enum", "abc", "copy",
    "pickle", "csv", "sqlite3", "socket", "http.client", "urllib.parse", "email.message",
    "xml.etree.ElementTree", "textwrap", "difflib", "zipfile", "tarfile", "tempfile", "glob",
    "fnmatch", "time",
)


def _docstrings(name: str) -> list[str]:
    try:
        mod = importlib.import_module(name)
    except ImportError:  # a stripped-down Python may lack e.g. sqlite3; the rest still stands
        return []
    out = [inspect.getdoc(mod) or ""]
    with warnings.catch_warnings():  # e.g. typing.io warns when read; its text is still wanted
        warnings.simplefilter("ignore", DeprecationWarning)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if name != "builtins" and getattr(obj, "__module__", name) != name:
                continue  # re-exported from elsewhere: counted where it is defined
            out.append(inspect.getdoc(obj) or "")
    return [d for d in out if d]


def _build() -> str:
    import pydoc_data.topics as topics
    parts = [topics.topics[k] for k in sorted(topics.topics)]
    for name in MODULES:
        parts.extend(_docstrings(name))
    return "\n\n".join(parts)


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> str:
    """The whole embedded corpus as one string.

    Built in a fresh, isolated interpreter (this file run on its own, ~0.3 s): docstrings are
    read from live objects, and a running process may have patched or extended the modules
    (pytest swaps sys hooks, other libraries monkeypatch), which would change the text — and a
    resumed training run must see exactly the text the first run saw."""
    out = subprocess.run([sys.executable, "-I", os.path.abspath(__file__)], capture_output=True,
                         check=True)
    return out.stdout.decode("utf-8")


PROSE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "alice.txt")
HELD_OUT = "CHAPTER X."  # where the held-out prose begins
CALIBRATION = ("the embedded mixed text (Alice's Adventures in Wonderland, chapters I-IX, "
               "and as much of Python's documentation, in alternating blocks)")


def prose(held_out: bool = False) -> str:
    """The shipped prose: chapters I-IX, or with ``held_out`` chapters X-XII."""
    with open(PROSE, encoding="utf-8") as f:
        text = f.read()
    cut = text.index(HELD_OUT)
    return text[cut:] if held_out else text[:cut]


def calibration_corpus(block: int = 16_384) -> str:
    """Prose and English about code in equal parts, in alternating blocks of about ``block``
    characters cut at blank lines: the default calibration text of ``jaxllm quantize``. Random
    windows (and SmoothQuant's held-out tail) then see both kinds; calibrated on the code
    documentation alone, GPTQ did worse on prose than plain rounding (docs/METHODS.md §7)."""
    story = prose()
    docs = builtin_corpus()[:len(story)]
    out = []
    for text in (story, docs):
        pieces, start = [], 0
        while start < len(text):
            end = text.find("\n\n", start + block)
            end = len(text) if end < 0 else end + 2
            pieces.append(text[start:end])
            start = end
        out.append(pieces)
    return "".join(p for pair in itertools.zip_longest(*out, fillvalue="") for p in pair)


if __name__ == "__main__":  # the isolated build above
    sys.stdout.buffer.write(_build().encode("utf-8"))
