"""Two helpers the rule files share: a lower bound on numeric fields, and the next multiple a fix names."""

from __future__ import annotations

from typing import Any


def at_least(section: str, obj: Any, low: int, *names: str) -> list[str]:
    too_small = [name for name in names if getattr(obj, name) < low]
    return [f"{section}.{name}={getattr(obj, name)!r} must be >= {low}" for name in too_small]


def next_multiple(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor
