"""The import graph has no cycle, between files or between packages.

Every import statement of every module (top-level and inside functions) is read with ``ast``;
relative imports are resolved against their package. A cycle between files makes import order
matter; a cycle between the top-level packages means neither can be understood (or installed)
without the other. Plug-ins (convert's reader and commands) are found through entry points, which
are not imports."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxllm", "pallas_kernels", "train", "convert")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, modules: dict) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts as a.b when b is a
    module, else as a)."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # jax.numpy -> not ours; a.b.c -> the longest known
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycle(graph: dict[str, set[str]]):
    """One cycle of ``graph`` as a list of nodes, or None."""
    state: dict = {}
    stack: list = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                got = visit(m)
                if got:
                    return got
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            got = visit(n)
            if got:
                return got
    return None


def _graphs():
    modules = _modules()
    files = {m: _imports(m, p, modules) for m, p in modules.items()}
    # A package's __init__ importing its own submodules is not a cycle of files.
    files = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in files.items()}
    packages: dict[str, set[str]] = {}
    for m, ts in files.items():
        packages.setdefault(m.split(".")[0], set()).update(
            t.split(".")[0] for t in ts if t.split(".")[0] != m.split(".")[0])
    return files, packages


def test_the_walker_sees_function_level_and_relative_imports():
    modules = _modules()
    assert "jaxllm.policy" in _imports("jaxllm.ppl", modules["jaxllm.ppl"], modules)
    # cli's commands import their helpers inside functions, two levels up
    assert "jaxllm.generate" in _imports("jaxllm.cli.generate", modules["jaxllm.cli.generate"],
                                         modules)
    assert "jaxllm.cli.common" in _imports("convert.cli", modules["convert.cli"], modules)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("level", ["files", "packages"])
def test_no_import_cycle(level):
    files, packages = _graphs()
    cycle = _cycle(files if level == "files" else packages)
    assert cycle is None, f"import cycle between {level}: {' -> '.join(cycle)}"


def test_packages_depend_downwards():
    """jaxllm needs only pallas_kernels; train and convert build on jaxllm, never the reverse."""
    _, packages = _graphs()
    assert packages["pallas_kernels"] == set()
    assert packages["jaxllm"] <= {"pallas_kernels"}
