"""Lazy attribute loading for package namespaces.

Why: each public name lives in a small module of its own; importing the package must stay cheap
(no Triton or torch.distributed import until a name is used) and one op's missing optional
dependency must not break the others.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]):
    """Return a module-level ``__getattr__`` that imports ``exports[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        # Why cache: importing ``package.grouped_gemm`` binds the *submodule* onto the package under
        # the same name as the public function; rebinding the function keeps ``package.name`` right.
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
