"""Ulysses pack / unpack: the sequence <-> head transposes around the context-parallel all-to-all.

Ulysses with P = ``world`` ranks: before attention each rank holds a sequence chunk of every head
and needs the whole sequence of H/P heads; after attention the reverse. One all-to-all
(``all_to_all_single`` on a [P, D] buffer: row p goes to rank p, row p of the received buffer
came from rank p) moves all of them, so Q, K and V (1 to 4 tensors, same dtype and device; head
counts and head dims may differ, e.g. GQA) travel together.

Layouts (every tensor contiguous, [batch b, seq, heads, head_dim d]):

``ulysses_pack(xs, P) -> buf [P, D]`` (sequence-sharded in): x_t is [b, s, H_t, d_t], H_t % P == 0,
h_t = H_t / P. Row p is the concatenation, over t in order, of
``x_t[:, :, p*h_t:(p+1)*h_t, :]`` flattened (a [b, s, h_t, d_t] piece): D = sum_t b*s*h_t*d_t.

``ulysses_unpack(recv, P, shapes) -> [y_t]`` (head-sharded out): ``shapes`` are the x_t shapes every
rank packed. recv[p] holds rank p's pieces in the same order; y_t is [b, P*s, h_t, d_t] with
``y_t[:, p*s:(p+1)*s] = piece t of recv[p]`` (rank p's sequence chunk comes p-th).

``ulysses_pack_reverse(ys, P) -> buf [P, D]`` (head-sharded in): y_t is [b, S, h_t, d_t], S % P == 0,
s = S / P. Row p is the concatenation over t of ``y_t[:, p*s:(p+1)*s]`` flattened ([b, s, h_t, d_t]).

``ulysses_unpack_reverse(recv, P, shapes) -> [x_t]`` (sequence-sharded out): ``shapes`` are the y_t
shapes every rank packed; x_t is [b, s, P*h_t, d_t] with ``x_t[:, :, p*h_t:(p+1)*h_t] = piece t of
recv[p]`` (rank p's head group comes p-th).

So unpack(all_to_all(pack(x))) gives the head-sharded full sequence, and
unpack_reverse(all_to_all(pack_reverse(y))) undoes it; the backward of each direction is the
other. KV heads fewer than P must be replicated by the caller first (H_t % P == 0 is checked).

Dispatch: csrc block-transpose kernel, all tensors in one launch (CUDA, extension built) ->
plain-torch reshape/permute/cat.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xorl_kernels._ext import (
    ext_ulysses_pack,
    ext_ulysses_pack_reverse,
    ext_ulysses_unpack,
    ext_ulysses_unpack_reverse,
    ulysses_piece_numels,
    use_cuda_ext,
)


def _check_inputs(tensors: Sequence[torch.Tensor], world: int, split_dim: int, op: str) -> list[int]:
    numels = ulysses_piece_numels([tuple(t.shape) for t in tensors], world, split_dim, op)
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{op}: every tensor must match tensors[0] ({first.dtype} on {first.device}); tensors[{i}] is "
                f"{t.dtype} on {t.device}"
            )
    return numels


def _check_recv(recv: torch.Tensor, world: int, numels: list[int], op: str) -> None:
    if tuple(recv.shape) != (world, sum(numels)):
        raise ValueError(
            f"{op}: recv must be [world, sum of piece sizes] = {(world, sum(numels))} for these shapes, got "
            f"{tuple(recv.shape)}; pass the shapes every rank packed"
        )


# ---------------------------------------------------------------------------------------------
# Plain-torch references
# ---------------------------------------------------------------------------------------------


def ulysses_pack_reference(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    _check_inputs(tensors, world, 2, "ulysses_pack")
    pieces = []
    for x in tensors:
        b, s, h, d = x.shape
        pieces.append(x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).reshape(world, -1))
    return torch.cat(pieces, dim=1)


def ulysses_unpack_reference(
    recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    numels = ulysses_piece_numels(shapes, world, 2, "ulysses_unpack")
    _check_recv(recv, world, numels, "ulysses_unpack")
    outs = []
    for piece, (b, s, h, d) in zip(recv.split(numels, dim=1), shapes):
        y = piece.reshape(world, b, s, h // world, d).permute(1, 0, 2, 3, 4)
        outs.append(y.reshape(b, world * s, h // world, d))
    return outs


def ulysses_pack_reverse_reference(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    _check_inputs(tensors, world, 1, "ulysses_pack_reverse")
    pieces = []
    for y in tensors:
        b, s, h, d = y.shape
        pieces.append(y.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).reshape(world, -1))
    return torch.cat(pieces, dim=1)


def ulysses_unpack_reverse_reference(
    recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    numels = ulysses_piece_numels(shapes, world, 1, "ulysses_unpack_reverse")
    _check_recv(recv, world, numels, "ulysses_unpack_reverse")
    outs = []
    for piece, (b, s, h, d) in zip(recv.split(numels, dim=1), shapes):
        x = piece.reshape(world, b, s // world, h, d).permute(1, 2, 0, 3, 4)
        outs.append(x.reshape(b, s // world, world * h, d))
    return outs


# ---------------------------------------------------------------------------------------------
# Dispatch (not differentiable by themselves: the context-parallel attention owns the autograd)
# ---------------------------------------------------------------------------------------------


def ulysses_pack(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Sequence-sharded [b, s, H_t, d_t] tensors -> send buffer [world, D]; see the module docstring."""
    _check_inputs(tensors, world, 2, "ulysses_pack")
    if use_cuda_ext(*tensors):
        return ext_ulysses_pack([t.contiguous() for t in tensors], world)
    return ulysses_pack_reference(tensors, world)


def ulysses_unpack(recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Received [world, D] -> head-sharded [b, world*s, H_t/world, d_t] tensors; see the module docstring."""
    if use_cuda_ext(recv):
        return ext_ulysses_unpack(recv.contiguous(), world, shapes)
    return [y.contiguous() for y in ulysses_unpack_reference(recv, world, shapes)]


def ulysses_pack_reverse(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Head-sharded [b, S, h_t, d_t] tensors -> send buffer [world, D]; see the module docstring."""
    _check_inputs(tensors, world, 1, "ulysses_pack_reverse")
    if use_cuda_ext(*tensors):
        return ext_ulysses_pack_reverse([t.contiguous() for t in tensors], world)
    return ulysses_pack_reverse_reference(tensors, world)


def ulysses_unpack_reverse(
    recv: torch.Tensor, world: int, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Received [world, D] -> sequence-sharded [b, S/world, world*h_t, d_t] tensors; see the module docstring."""
    if use_cuda_ext(recv):
        return ext_ulysses_unpack_reverse(recv.contiguous(), world, shapes)
    return [x.contiguous() for x in ulysses_unpack_reverse_reference(recv, world, shapes)]
