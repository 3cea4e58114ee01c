"""Ulysses pack / unpack in plain torch: the references the csrc kernels are checked against, and
the path off CUDA. The layouts are documented in ulysses/layout.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xorl_kernels.ulysses.layout import check_pack_inputs, check_recv, ulysses_piece_numels


def ulysses_pack_reference(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    check_pack_inputs(tensors, world, 2, "ulysses_pack")
    pieces = []
    for x in tensors:
        b, s, h, d = x.shape
        pieces.append(x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).reshape(world, -1))
    return torch.cat(pieces, dim=1)


def ulysses_unpack_reference(
    recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    numels = ulysses_piece_numels(shapes, world, 2, "ulysses_unpack")
    check_recv(recv, world, numels, "ulysses_unpack")
    outs = []
    for piece, (b, s, h, d) in zip(recv.split(numels, dim=1), shapes):
        y = piece.reshape(world, b, s, h // world, d).permute(1, 0, 2, 3, 4)
        outs.append(y.reshape(b, world * s, h // world, d))
    return outs


def ulysses_pack_reverse_reference(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    check_pack_inputs(tensors, world, 1, "ulysses_pack_reverse")
    pieces = []
    for y in tensors:
        b, s, h, d = y.shape
        pieces.append(y.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).reshape(world, -1))
    return torch.cat(pieces, dim=1)


def ulysses_unpack_reverse_reference(
    recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    numels = ulysses_piece_numels(shapes, world, 1, "ulysses_unpack_reverse")
    check_recv(recv, world, numels, "ulysses_unpack_reverse")
    outs = []
    for piece, (b, s, h, d) in zip(recv.split(numels, dim=1), shapes):
        x = piece.reshape(world, b, s // world, h, d).permute(1, 2, 0, 3, 4)
        outs.append(x.reshape(b, s // world, world * h, d))
    return outs
