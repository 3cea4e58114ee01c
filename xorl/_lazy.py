"""Lazy attribute loading for package namespaces.

Why: each public name lives in a small module of its own; importing the package must stay cheap
(no Triton or torch.distributed import until a name is used) and one op's missing optional
dependency must not break the others.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _ExportsWinModule(types.ModuleType):
    """A package whose public names win over same-named submodules.

    Why: ``import xorl_kernels.flash_attn`` (a submodule import, e.g. from ring attention) makes
    the import system bind the *module* onto the package as ``flash_attn`` after it runs, which
    would shadow the public function of the same name for every later
    ``from xorl_kernels import flash_attn``. Binding the module's same-named attribute instead
    keeps the public name right whichever import happens first (the module stays in sys.modules).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if (
            isinstance(value, types.ModuleType)
            and exports.get(name) == f".{name}"
            and value.__name__ == f"{self.__name__}.{name}"
            and hasattr(value, name)
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_getattr(package: str, exports: dict[str, str]):
    """Return a module-level ``__getattr__`` that imports ``exports[name]`` on first use."""
    module_obj = sys.modules.get(package)
    if module_obj is not None and type(module_obj) is types.ModuleType:
        module_obj.__dict__["_lazy_exports"] = exports
        module_obj.__class__ = _ExportsWinModule

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
