"""The box of a global tensor that this rank holds: what a sharded start reads or generates.

Why from the DTensor itself: FSDP2, TP and EP each record their split in the parameter's
placements and mesh (FSDP over TP or EP makes a strided 2-D layout), and torch computes the
local piece from those (``compute_local_shape_and_global_offset``). Re-deriving layouts here would
duplicate every plan's rules and drift from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from xorl._torch_compat import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class ShardBox:
    """This rank's piece of a tensor of ``global_shape``: ``shape`` elements from ``offset`` on."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape) -> ShardBox:
        shape = tuple(shape)
        return cls(shape, (0,) * len(shape), shape)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def shard_box(tensor: torch.Tensor) -> ShardBox:
    """The box ``tensor`` holds: its local piece of a DTensor, or the whole of a plain tensor."""
    if not isinstance(tensor, DTensor):
        return ShardBox.whole(tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    box = ShardBox(tuple(tensor.shape), tuple(offset), tuple(shape))
    local = tuple(tensor.to_local().shape)
    if local != box.shape:  # a layout torch's helper does not describe as one box: refuse, never guess
        raise ValueError(
            f"the local shard {local} of a DTensor {tuple(tensor.shape)} with placements {tensor.placements} "
            f"is not the box {box.shape} at {box.offset} that its placements describe"
        )
    return box


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The storage to write this rank's box into (a DTensor's local shard, else the tensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parameter_box(model, raw_name: str, tensor: torch.Tensor) -> ShardBox:
    """``shard_box``, plus one layout that is not a DTensor: the plain ``experts.*`` tensors of an
    expert-parallel block built with a process group (not the EP mesh), which hold the experts
    ``owner.local_expert_range`` of ``owner.num_experts`` (see xorl.nn.MoE)."""
    parts = raw_name.split(".")
    if isinstance(tensor, DTensor) or len(parts) < 3 or parts[-2] != "experts":
        return shard_box(tensor)
    owner = model.get_submodule(".".join(parts[:-2]))
    expert_range = getattr(owner, "local_expert_range", None)
    num_experts = getattr(owner, "num_experts", None)
    if expert_range is None or num_experts is None or tensor.shape[0] == num_experts:
        return shard_box(tensor)
    first, last = expert_range
    if last - first != tensor.shape[0]:
        raise ValueError(f"{raw_name}: holds {tensor.shape[0]} experts, local_expert_range is {expert_range}")
    shape = tuple(tensor.shape)
    return ShardBox((int(num_experts), *shape[1:]), (first,) + (0,) * (len(shape) - 1), shape)
