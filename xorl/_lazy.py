"""Lazy attribute loading for package namespaces.

Why: each public name lives in a small module of its own; importing the package must stay cheap
(no Triton or torch.distributed import until a name is used) and one op's missing optional
dependency must not break the others. Modules are named differently from the public names they
hold (``flash_attention.py`` holds ``flash_attn``), so importing a submodule never shadows one.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]):
    """Return a module-level ``__getattr__`` that imports ``exports[name]`` on first use."""
    clashes = [name for name, module in exports.items() if module.lstrip(".") == name]
    if clashes:
        raise ValueError(f"{package}: public names {clashes} equal their module names; rename the modules")

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # cache: the next lookup is a plain attribute
        return value

    return __getattr__
