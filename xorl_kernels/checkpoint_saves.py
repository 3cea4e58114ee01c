"""The custom ops whose outputs selective activation checkpointing keeps: a registry each op joins.

Why a registry: the save list used to be a list of names in the checkpointing plan, and a name
that was not (or no longer) a registered op was silently skipped, so a renamed op would quietly be
recomputed (a collective sent twice). Now the module that defines a ``torch.library`` custom op
says, next to it, that selective checkpointing saves its output (attention, expert matmuls and
collectives, which a recompute would run or send again); ``SELECTIVE_CHECKPOINT_SAVES.ops()``
resolves every name and raises on one that is not a registered op. xorl's own ops (xorl/nn) join
the same registry: xorl may import xorl_kernels, never the reverse.
"""

from __future__ import annotations

import torch


class OpRegistry:
    """Qualified custom-op names (``"xorl::flash_attn"``) and their resolution to op overloads."""

    def __init__(self):
        self._names: list[str] = []

    def join(self, qualname: str) -> None:
        namespace, sep, name = qualname.partition("::")
        if not sep or not namespace or not name:
            raise ValueError(f"{qualname!r}: give a custom op's qualified name, 'namespace::name'")
        if qualname not in self._names:
            self._names.append(qualname)

    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def ops(self) -> set:
        """Every joined op's default overload; a name that is no registered op is an error."""
        ops, unknown = set(), []
        for qualname in self._names:
            namespace, _, name = qualname.partition("::")
            packet = getattr(getattr(torch.ops, namespace), name, None)
            if packet is None:
                unknown.append(qualname)
            else:
                ops.add(packet.default)
        if unknown:
            raise RuntimeError(f"selective checkpointing was told to save ops that are not registered: {unknown}")
        return ops


SELECTIVE_CHECKPOINT_SAVES = OpRegistry()
