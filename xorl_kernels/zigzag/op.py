"""Zig-zag gather / scatter, dispatched and differentiable: the csrc kernel on CUDA (extension built),
the plain-torch index_select / index_copy elsewhere. The layout is documented in zigzag/layout.py.

``zigzag_gather(x, dim, rank, world, cu_seqlens=None)``: rank's shard (None: every shard in rank order).
``zigzag_scatter(y, dim, rank, world, cu_seqlens=None, out=None)``: the inverse (in place into
``out`` when given, then not differentiable). The backward of one is the other.
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import CSRC, REFERENCE, pick_backend
from xorl_kernels.zigzag.csrc import ext_zigzag_copy
from xorl_kernels.zigzag.layout import (
    check_args,
    check_scatter_out,
    check_seq_len,
    new_scatter_out,
    prepare_cu_seqlens,
    scatter_seq_len,
    zigzag_positions,
)

_AVAILABLE = (CSRC, REFERENCE)


def _gather(x, dim, rank, world, cu):
    if pick_backend("zigzag_gather", [x], _AVAILABLE) == CSRC:
        x = x.contiguous()
        rank_begin, num_ranks = (0, world) if rank is None else (rank, 1)
        shape = list(x.shape)
        shape[dim] = num_ranks * (x.shape[dim] // world)
        local = x.new_empty(shape)
        ext_zigzag_copy(x, local, dim, rank_begin, num_ranks, world, cu, scatter=False)
        return local
    return x.index_select(dim, zigzag_positions(x.shape[dim], rank, world, cu, x.device))


def _scatter(y, dim, rank, world, cu, out):
    seq_len = scatter_seq_len(y, dim, rank, world)
    if out is None:
        out = new_scatter_out(y, dim, rank, seq_len)
    if pick_backend("zigzag_scatter", [y, out], _AVAILABLE) == CSRC and out.is_contiguous():
        rank_begin, num_ranks = (0, world) if rank is None else (rank, 1)
        ext_zigzag_copy(out, y.contiguous(), dim, rank_begin, num_ranks, world, cu, scatter=True)
        return out
    return out.index_copy_(dim, zigzag_positions(seq_len, rank, world, cu, y.device), y)


class _ZigzagGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world, cu):
        ctx.args = (dim, rank, world)
        ctx.save_for_backward(cu)
        return _gather(x, dim, rank, world, cu)

    @staticmethod
    def backward(ctx, grad):
        (cu,) = ctx.saved_tensors
        dim, rank, world = ctx.args
        return _scatter(grad, dim, rank, world, cu, None), None, None, None, None


class _ZigzagScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dim, rank, world, cu):
        ctx.args = (dim, rank, world)
        ctx.save_for_backward(cu)
        return _scatter(y, dim, rank, world, cu, None)

    @staticmethod
    def backward(ctx, grad):
        (cu,) = ctx.saved_tensors
        dim, rank, world = ctx.args
        return _gather(grad, dim, rank, world, cu), None, None, None, None


def zigzag_gather(
    x: torch.Tensor, dim: int, rank: int | None, world: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank ``rank``'s zig-zag shard of ``x`` along ``dim`` (None: all shards in rank order). See module doc."""
    dim = check_args("zigzag_gather", x, dim, rank, world)
    check_seq_len("zigzag_gather", x.shape[dim], world, cu_seqlens)
    cu = prepare_cu_seqlens("zigzag_gather", cu_seqlens, x.shape[dim], world, x.device)
    return _ZigzagGatherFn.apply(x, dim, rank, world, cu)


def zigzag_scatter(
    y: torch.Tensor,
    dim: int,
    rank: int | None,
    world: int,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write shard(s) ``y`` to their zig-zag rows of the full sequence; the inverse of zigzag_gather.

    With ``out`` the rows are written into it in place (not differentiable); see module doc.
    """
    dim = check_args("zigzag_scatter", y, dim, rank, world)
    seq_len = scatter_seq_len(y, dim, rank, world)
    check_seq_len("zigzag_scatter", seq_len, world, cu_seqlens)
    cu = prepare_cu_seqlens("zigzag_scatter", cu_seqlens, seq_len, world, y.device)
    if out is None:
        return _ZigzagScatterFn.apply(y, dim, rank, world, cu)
    check_scatter_out(out, y, dim, seq_len)
    with torch.no_grad():
        return _scatter(y, dim, rank, world, cu, out)
