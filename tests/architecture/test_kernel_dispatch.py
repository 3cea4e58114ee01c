"""xorl_kernels' structure: one parse of the backend switches, no import cycles, nothing from xorl/.

The import checks run each module in a fresh interpreter: importing a module first is how a cycle
shows (its partner then sees it half-initialised), which one shared interpreter would hide.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys

import pytest
import torch

import xorl_kernels
from tests.support.paths import REPO
from xorl_kernels import dispatch

ROOT = REPO


def kernel_modules() -> list[str]:
    names = ["xorl_kernels"]
    for info in pkgutil.walk_packages(xorl_kernels.__path__, "xorl_kernels."):
        if not info.name.endswith("._C"):
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("YES", True), ("on", True),
                                            ("0", False), ("false", False), ("no", False), ("", False)])
def test_force_reference_parses_one_way(monkeypatch, value, expected):
    monkeypatch.setenv("XORL_FORCE_REFERENCE", value)
    assert dispatch.force_reference() is expected


def test_unknown_switch_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("XORL_FORCE_REFERENCE", "maybe")
    with pytest.raises(ValueError, match="XORL_FORCE_REFERENCE='maybe'"):
        dispatch.force_reference()
    monkeypatch.setenv("XORL_CHECK_GROUP_SIZES", "2")
    with pytest.raises(ValueError, match="XORL_CHECK_GROUP_SIZES"):
        dispatch.env_flag("XORL_CHECK_GROUP_SIZES")


def test_pick_backend_order_and_requests(monkeypatch):
    cpu = torch.zeros(2)
    every = dispatch.BACKENDS
    assert dispatch.pick_backend("op", [cpu], every) == "torch_cpu"  # the op has torch's own CPU kernel
    assert dispatch.pick_backend("op", [cpu], ("triton", "reference")) == "reference"  # it has none
    assert dispatch.pick_backend("op", [cpu, None], every, "triton") == "triton"  # a request is taken as is
    with pytest.raises(ValueError, match="op: backend must be one of"):
        dispatch.pick_backend("op", [cpu], ("triton", "reference"), "csrc")
    # A CUDA tensor, faked: the first backend the op has, unless the reference is forced.
    monkeypatch.setattr(type(cpu), "is_cuda", property(lambda t: True))
    monkeypatch.setattr(dispatch.cuda_ext, "ext_runs_on", lambda *t: True)
    assert dispatch.pick_backend("op", [cpu], every) == "csrc"
    assert dispatch.pick_backend("op", [cpu], ("triton", "reference")) == "triton"
    monkeypatch.setattr(dispatch.cuda_ext, "ext_runs_on", lambda *t: False)
    assert dispatch.pick_backend("op", [cpu], every) == "triton"
    assert dispatch.pick_backend("op", [cpu], ("csrc", "reference")) == "reference"
    monkeypatch.setenv("XORL_FORCE_REFERENCE", "1")
    assert dispatch.pick_backend("op", [cpu], every) == "reference"


def import_graph() -> dict[str, set[str]]:
    """module -> the xorl_kernels modules it imports anywhere in its body (lazy imports included)."""
    modules = set(kernel_modules())
    graph = {}
    for name in modules:
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: use absolute imports (names grep finds)"
                base = node.module
                # "from pkg import mod" imports the module pkg.mod when there is one (_C: the extension).
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules | {"xorl_kernels._C"} else base
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_no_import_cycles():
    """No module of xorl_kernels reaches itself through the modules it imports (top-level or lazy),
    and no module imports a package's __init__ (which imports the op modules: a cycle in waiting);
    modules import their siblings by full name."""
    graph = import_graph()
    cycles = []

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif len(path) < len(graph):
                visit(nxt, path + [nxt])

    for start in graph:
        visit(start, [start])
    assert not cycles, f"import cycles: {sorted(set(' -> '.join(c) for c in cycles))[:5]}"
    packages = {n for n in graph if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    upward = {n: graph[n] & packages for n in graph if graph[n] & packages and n not in packages}
    assert not upward, f"modules import a package __init__ (a cycle through it): {upward}"


@pytest.mark.slow
def test_public_names_are_functions_and_nothing_comes_from_xorl():
    """Every module imported in one fresh interpreter: no xorl.* module loads, and importing the
    folders never rebinds the public functions."""
    code = (
        "import importlib, sys, xorl_kernels\n"
        f"for name in {kernel_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "for name in xorl_kernels.__all__:\n"
        "    value = getattr(xorl_kernels, name)\n"
        "    assert callable(value) and value.__name__ == name, (name, value)\n"
        "upward = sorted(m for m in sys.modules if m == 'xorl' or m.startswith('xorl.'))\n"
        "assert not upward, upward\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
