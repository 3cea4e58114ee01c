"""Ulysses pack / unpack: the layouts and the shape checks.

The sequence <-> head transposes around the context-parallel all-to-all.

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

The dispatching entry points are in ulysses/op.py (csrc block-transpose kernel, all tensors in
one launch, on CUDA; the plain-torch references of ulysses/reference.py elsewhere).
"""


from __future__ import annotations

from collections.abc import Sequence

import torch


def ulysses_piece_numels(shapes: Sequence[Sequence[int]], world: int, split_dim: int, op: str) -> list[int]:
    """Elements each packed tensor contributes to one destination's chunk, after checking the shapes.

    ``shapes`` are the [b, s, heads, head_dim] shapes given to the pack; ``split_dim`` is the dim
    the pack splits across ranks (2: heads, for ulysses_pack; 1: sequence, for ulysses_pack_reverse).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"{op}: world must be a positive int, got {world!r}")
    if not 1 <= len(shapes) <= 4:
        raise ValueError(f"{op}: pass 1 to 4 tensors/shapes (e.g. q, k, v), got {len(shapes)}")
    what = {1: "sequence length", 2: "number of heads"}[split_dim]
    numels = []
    for i, shape in enumerate(shapes):
        if len(shape) != 4:
            raise ValueError(
                f"{op}: tensor {i} must be [batch, seq, heads, head_dim], got shape {tuple(shape)}"
            )
        if shape[split_dim] % world != 0:
            raise ValueError(
                f"{op}: tensor {i} has {what} {shape[split_dim]}, not divisible by world={world}; "
                "pad it or replicate heads first"
            )
        b, s, h, d = shape
        numels.append(b * s * h * d // world)
    return numels


def check_pack_inputs(tensors: Sequence[torch.Tensor], world: int, split_dim: int, op: str) -> list[int]:
    numels = ulysses_piece_numels([tuple(t.shape) for t in tensors], world, split_dim, op)
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{op}: every tensor must match tensors[0] ({first.dtype} on {first.device}); tensors[{i}] is "
                f"{t.dtype} on {t.device}"
            )
    return numels


def check_recv(recv: torch.Tensor, world: int, numels: list[int], op: str) -> None:
    if tuple(recv.shape) != (world, sum(numels)):
        raise ValueError(
            f"{op}: recv must be [world, sum of piece sizes] = {(world, sum(numels))} for these shapes, got "
            f"{tuple(recv.shape)}; pass the shapes every rank packed"
        )
