"""Entering and leaving tensor-parallel regions: split / gather along a dim, and gradient sums.

Each function says what its backward does, because that is where TP goes wrong:

* ``split_to_shard(x, dim)``: x is replicated (every rank holds the same full tensor); keep this
  rank's chunk. Backward all-gathers, so the upstream gradient is again full and identical on
  every rank (used to enter the sequence-parallel region after the embedding, and for a row layer
  whose input is not yet parallel).
* ``gather_from_shards(x, dim)``: every rank holds its chunk; return the full tensor. Backward
  keeps this rank's chunk of the gradient: the code after the gather runs identically on every
  rank (replicated lm_head, replicated loss), so the gradient is already complete everywhere;
  summing it (reduce-scatter) would count it P times.
* ``sum_grad_over_tp(t)``: identity forward, all-reduce of the gradient backward: for a replicated
  parameter whose per-rank use sees only part of the data (RMSNorm on a sequence shard, q/k
  norms on a subset of heads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xorl.nn.tp_comm import TPGroup, _all_gather_single


def _check_divisible(size: int, tp: TPGroup, dim: int, what: str) -> int:
    if size % tp.size:
        raise ValueError(
            f"{what}: dim {dim} has size {size}, not divisible by tensor_parallel_size={tp.size}; "
            "pad it to a multiple of the TP size"
        )
    return size // tp.size


def _all_gather_dim(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    dim = dim % x.dim()
    x = x.contiguous()
    out = x.new_empty(tp.size, *x.shape)
    _all_gather_single(out.flatten(0, 1), x, group=tp.group)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _own_chunk(x: torch.Tensor, tp: TPGroup, dim: int, what: str) -> torch.Tensor:
    shard = _check_divisible(x.shape[dim], tp, dim, what)
    return x.narrow(dim, tp.rank * shard, shard).contiguous()


class _SplitToShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim
        return _own_chunk(x, tp, dim, "split_to_shard")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.tp, ctx.dim), None, None


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim
        return _all_gather_dim(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.tp, ctx.dim, "gather_from_shards backward"), None, None


class _SumGradOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, tp: TPGroup):
        ctx.tp = tp
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


def split_to_shard(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Replicated x -> this rank's chunk along ``dim``; backward all-gathers the gradient."""
    return x if tp.size == 1 else _SplitToShard.apply(x, tp, dim)


def gather_from_shards(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Per-rank chunks -> the full tensor along ``dim``; backward keeps this rank's gradient chunk."""
    return x if tp.size == 1 else _GatherFromShards.apply(x, tp, dim)


def sum_grad_over_tp(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity; the gradient flowing back through it is summed over the TP ranks."""
    return t if tp.size == 1 else _SumGradOverTP.apply(t, tp)
