"""Typed config values: a dataclass's field types, and coercing a YAML / JSON / CLI value to one.

Why a module of its own: xorl/config/sections.py (the run config's sections) and xorl/config/model_path.py (a
folder's config.json read into model fields) both coerce values to field types, and model_path is
itself called from config's loading; here, neither imports the other.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from xorl.config.errors import ConfigError, did_you_mean

_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    """The dataclass fields of ``cls`` with their resolved types (cached)."""
    if cls not in _HINTS:
        names = {f.name for f in dataclasses.fields(cls)}
        _HINTS[cls] = {k: v for k, v in get_type_hints(cls).items() if k in names}
    return _HINTS[cls]


def accepts_str(tp: Any) -> bool:
    return tp is str or (is_union(tp) and str in get_args(tp))


def is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if is_union(tp):
        return " or ".join("null" if a is type(None) else type_name(a) for a in get_args(tp))
    if get_origin(tp) in (list, tuple):
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, name: str) -> Any:
    """``value`` as type ``tp`` (int, float, bool, str, Literal, X | None, list[X], tuple[X, ...])."""
    origin = get_origin(tp)
    wrong = ConfigError(f"{name}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise ConfigError(
            f"{name}={value!r} is not one of {list(choices)}"
            + did_you_mean(str(value), [str(c) for c in choices])
        )
    if is_union(tp):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ConfigError:
                continue
        raise wrong
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise wrong
        (item_tp,) = get_args(tp)
        return [coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        item_tps = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_tps):
            raise ConfigError(
                f"{name}: expected a list of {len(item_tps)} values ({type_name(tp)}), got {value!r}"
            )
        return tuple(coerce(v, t, f"{name}[{i}]") for i, (v, t) in enumerate(zip(value, item_tps)))
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise wrong
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "3e-4" (no dot) as a string; it is plainly a float.
            try:
                return float(value)
            except ValueError:
                pass
        raise wrong
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r} ({type(value).__name__}); quote it")
    raise TypeError(f"{name}: unsupported field type {tp!r}")  # a bug in the dataclass, not in the input
