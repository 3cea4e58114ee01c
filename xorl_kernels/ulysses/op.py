"""Ulysses pack / unpack, dispatched: the csrc block-transpose kernel (every tensor in one launch) on
CUDA when the extension is built, the plain-torch references elsewhere. Layouts: ulysses/layout.py.

Not differentiable by themselves: the context-parallel attention (xorl.nn) owns the autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xorl_kernels.dispatch import CSRC, REFERENCE, pick_backend
from xorl_kernels.ulysses.csrc import (
    ext_ulysses_pack,
    ext_ulysses_pack_reverse,
    ext_ulysses_unpack,
    ext_ulysses_unpack_reverse,
)
from xorl_kernels.ulysses.layout import check_pack_inputs
from xorl_kernels.ulysses.reference import (
    ulysses_pack_reference,
    ulysses_pack_reverse_reference,
    ulysses_unpack_reference,
    ulysses_unpack_reverse_reference,
)

_AVAILABLE = (CSRC, REFERENCE)


def ulysses_pack(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Sequence-sharded [b, s, H_t, d_t] tensors -> send buffer [world, D]; layout in ulysses/reference.py."""
    check_pack_inputs(tensors, world, 2, "ulysses_pack")
    if pick_backend("ulysses_pack", tensors, _AVAILABLE) == CSRC:
        return ext_ulysses_pack([t.contiguous() for t in tensors], world)
    return ulysses_pack_reference(tensors, world)


def ulysses_unpack(recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Received [world, D] -> head-sharded [b, world*s, H_t/world, d_t] tensors; layout in ulysses/reference.py."""
    if pick_backend("ulysses_unpack", [recv], _AVAILABLE) == CSRC:
        return ext_ulysses_unpack(recv.contiguous(), world, shapes)
    return [y.contiguous() for y in ulysses_unpack_reference(recv, world, shapes)]


def ulysses_pack_reverse(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Head-sharded [b, S, h_t, d_t] tensors -> send buffer [world, D]; layout in ulysses/reference.py."""
    check_pack_inputs(tensors, world, 1, "ulysses_pack_reverse")
    if pick_backend("ulysses_pack_reverse", tensors, _AVAILABLE) == CSRC:
        return ext_ulysses_pack_reverse([t.contiguous() for t in tensors], world)
    return ulysses_pack_reverse_reference(tensors, world)


def ulysses_unpack_reverse(
    recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Received [world, D] -> sequence-sharded [b, S/world, world*h_t, d_t] tensors; layout in ulysses/reference.py."""
    if pick_backend("ulysses_unpack_reverse", [recv], _AVAILABLE) == CSRC:
        return ext_ulysses_unpack_reverse(recv.contiguous(), world, shapes)
    return [x.contiguous() for x in ulysses_unpack_reverse_reference(recv, world, shapes)]
