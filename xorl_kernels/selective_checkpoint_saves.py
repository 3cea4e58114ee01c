"""The custom ops whose outputs selective activation checkpointing keeps: a registry each op joins.

Why a registry: the save list used to be a list of names in the checkpointing plan, and a name
that was not (or no longer) a registered op was silently skipped, so a renamed op would quietly be
recomputed (a collective sent twice). Now the module that defines a ``torch.library`` custom op
says, next to it, that selective checkpointing saves its output (attention, expert matmuls and
collectives, which a recompute would run or send again); ``SELECTIVE_CHECKPOINT_SAVES.ops()``
resolves every name and raises on one that is not a registered op. xorl's own ops (xorl/nn) join
the same registry: xorl may import xorl_kernels, never the reverse.

An op that runs dense matmuls inside (the tensor-parallel linears: xorl/nn/tp_linear_ops.py) says
how many (``matmuls``, a function of the op's arguments), so that selective_checkpoint:
every_other_matmul counts them in the block's order as it counts aten.mm / addmm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class OpRegistry:
    """Qualified custom-op names (``"xorl::flash_attn"``) and their resolution to op overloads."""

    def __init__(self):
        self._names: list[str] = []
        self._matmuls: dict[str, Callable] = {}

    def join(self, qualname: str, matmuls: Callable | None = None) -> None:
        """Keep ``qualname``'s output; ``matmuls(*args)``: how many dense matmuls one call runs."""
        namespace, sep, name = qualname.partition("::")
        if not sep or not namespace or not name:
            raise ValueError(f"{qualname!r}: give a custom op's qualified name, 'namespace::name'")
        if qualname not in self._names:
            self._names.append(qualname)
        if matmuls is not None:
            self._matmuls[qualname] = matmuls

    def dense_matmuls(self, op, args) -> int:
        """How many dense matmuls a call of ``op`` (an OpOverload) with ``args`` runs: 0 for an op that
        did not say (attention, collectives)."""
        count = self._matmuls.get(op._schema.name) if hasattr(op, "_schema") else None
        return 0 if count is None else count(*args)

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
