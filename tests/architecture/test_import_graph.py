"""No import cycles anywhere in xorl/ or xorl_kernels/, and every module imports.

The graph is read statically (ast over every module, as tests/architecture/test_kernel_dispatch.py does for the
kernel boundary): an edge A -> B for every ``import B`` / ``from B import name`` in A, at the top
or inside a function (a lazy import is a cycle that waits for its first call), except under
``if TYPE_CHECKING:`` (never executed). ``from pkg import mod`` is an edge to the module
``pkg.mod``; ``from pkg import name`` to the package's ``__init__``. A cycle fails the test and
is printed, module by module.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO
PACKAGES = ("xorl", "xorl_kernels")
EXTENSION = "xorl_kernels._C"


def all_modules() -> dict[str, Path]:
    """module name -> its file, for every module of xorl/ and xorl_kernels/ (the extension excepted)."""
    modules = {}
    for package in PACKAGES:
        modules[package] = ROOT / package / "__init__.py"
        for info in pkgutil.walk_packages([str(ROOT / package)], f"{package}."):
            if info.name.endswith("._C"):
                continue
            base = ROOT / info.name.replace(".", "/")
            modules[info.name] = base / "__init__.py" if info.ispkg else base.with_suffix(".py")
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_in(child))
            continue
        yield from _imports(node)


def _imports_in(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                # The CUDA extension xorl_kernels._C is a module too (a leaf: it imports nothing of ours).
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules.keys() | {EXTENSION} else base
                           for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan), each as a closed path."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:  # a shortest closed path through the component's first member
        start = min(component)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nexts = sorted(graph[path[-1]] & component)
            if start in nexts:
                cycles.append(path + [start])
                break
            for nxt in nexts:
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append(path + [nxt])
    return cycles


def test_the_walk_finds_a_cycle_and_the_real_edges():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "xorl.distributed.p2p" in graph["xorl.nn.ring_attention"]  # a top-level import
    assert "xorl_kernels.attention.op" in graph["xorl.nn.ring_attention"]  # a lazy one, in a method
    assert not any(m.startswith("xorl.") or m == "xorl" for e in
                   (graph[n] for n in graph if n.startswith("xorl_kernels")) for m in e)


def test_no_import_cycles_in_xorl_or_xorl_kernels():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports(package):
    """A broken import anywhere fails the quick tier (entry points, bench and tests import less)."""
    for name in sorted(m for m in all_modules() if m == package or m.startswith(package + ".")):
        importlib.import_module(name)
