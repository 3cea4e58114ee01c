"""The error every config check raises, and the "did you mean" hint its messages share.

Why a module of its own: both ``xorl.config`` and ``xorl.distributed.parallel_config`` raise it,
and neither may import the other's heavier dependencies (torch) just to name an exception.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config value that cannot work. ``problems`` lists each one; the message names field and fix."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"invalid config ({len(self.problems)} problems):\n{lines}"
        super().__init__(message)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string when none is close."""
    by_lower = {c.lower(): c for c in candidates}  # case-insensitive: "1f1b" -> "1F1B"
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[match[0]]!r}?)" if match else ""
