"""Tensor parallelism's region boundaries: where a tensor enters or leaves the TP region, each an
autograd pair on the TP group (``xorl/nn/tp_comm.py``).

Region boundaries (each says what its backward does, because that is where TP goes wrong):

* ``split_to_shard(x, dim)``: x is replicated; keep this rank's chunk. Backward all-gathers, so the
  upstream gradient is again full and identical on every rank (entering the sequence-parallel
  region after the embedding; a row layer whose input is not yet parallel).
* ``gather_from_shards(x, dim)``: every rank holds its chunk; return the full tensor. Backward
  keeps this rank's chunk of the gradient: the code after the gather runs identically on every
  rank (replicated lm_head and loss), so the gradient is already complete everywhere; summing it
  would count it P times.
* ``sum_partials(x)`` / ``sum_partials_to_shard(x, dim)``: every rank holds a partial sum (a
  vocabulary-parallel embedding's rows); all-reduce it, or reduce-scatter it along ``dim``
  straight into the sequence-parallel shard. Backward: identity / all-gather, since each rank's
  partial was computed from the same upstream values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xorl._torch_compat import resolve_process_group
from xorl.nn.tp_comm import TPGroup, all_gather_single, reduce_scatter_single
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

# The forward collectives of the regions are torch.library custom ops that selective activation
# checkpointing keeps (xorl/parallel/data_parallel.py): a region inside a decoder block (a LoRA
# adapter's rank-wide activation under TP, MLA's shared RoPE key) is then not sent again by the
# recompute in backward. Out of place: an all-reduce in place on its input would change a tensor
# the checkpoint may hold (a kept matmul output), and the recompute would reduce it twice.
# The process group travels by name (custom ops take no Python objects).


SELECTIVE_CHECKPOINT_SAVES.join("xorl::tp_all_gather")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::tp_all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    group = resolve_process_group(group_name)
    x = x.contiguous()
    out = x.new_empty(dist.get_world_size(group), *x.shape)
    all_gather_single(out.flatten(0, 1), x, group=group)
    return out.movedim(0, dim).flatten(dim, dim + 1).contiguous()


@_all_gather_op.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(resolve_process_group(group_name))
    return x.new_empty(shape)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::tp_reduce_scatter")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::tp_reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    group = resolve_process_group(group_name)
    size = dist.get_world_size(group)  # [.., size*c (dim), ..] -> the rank-stacked [size, .., c, ..]
    stacked = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = x.new_empty(stacked.shape[1:])
    reduce_scatter_single(out, stacked.flatten(0, 1), group=group)
    return out


@_reduce_scatter_op.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] //= dist.get_world_size(resolve_process_group(group_name))
    return x.new_empty(shape)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::tp_all_reduce")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=resolve_process_group(group_name))
    return out


@_all_reduce_op.register_fake
def _(x, group_name):
    return x.new_empty(x.shape)


def _all_gather_dim(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    return torch.ops.xorl.tp_all_gather(x, dim % x.dim(), tp.group.group_name)


def _reduce_scatter_dim(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    return torch.ops.xorl.tp_reduce_scatter(x, dim % x.dim(), tp.group.group_name)


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return torch.ops.xorl.tp_all_reduce(x, tp.group.group_name)


def _own_chunk(x: torch.Tensor, tp: TPGroup, dim: int, what: str) -> torch.Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"{what}: dim {dim} has size {x.shape[dim]}, not divisible by tensor_parallel_size={tp.size}; "
            "pad it to a multiple of the TP size"
        )
    shard = x.shape[dim] // tp.size
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


def to_head_parallel(x: torch.Tensor, tp: TPGroup, sequence_dim: int | None = None) -> torch.Tensor:
    """A replicated activation that every TP rank's heads then use (MLA's shared RoPE key): the
    forward keeps it (or, under sequence parallel, all-gathers the sequence along ``sequence_dim``);
    the backward sums the ranks' partial gradients (all-reduce, or reduce-scatter back to the shard),
    as a column layer does for its input."""
    if tp.size == 1:
        return x
    # the same autograd pair LoRA's adapters use (copy_to_region / gather_summing_grads below)
    return copy_to_region(x, tp) if sequence_dim is None else gather_summing_grads(x, tp, sequence_dim)


class ToHeadParallel(nn.Module):
    """``to_head_parallel`` as a module, for the place in a model where one activation meets every
    rank's heads (MLA's ``rope_key_to_heads``: an ``nn.Identity`` there until the TP layout puts this
    in its slot). ``sequence_parallel``: the activation arrives as this rank's sequence shard
    (sequence dim -2) and is all-gathered."""

    def __init__(self, tp: TPGroup, sequence_parallel: bool):
        super().__init__()
        self.tp = tp
        self.sequence_parallel = bool(sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return to_head_parallel(x, self.tp, -2 if self.sequence_parallel else None)

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, sequence_parallel={self.sequence_parallel}"


def split_to_shard(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Replicated x -> this rank's chunk along ``dim``; backward all-gathers the gradient."""
    return x if tp.size == 1 else _SplitToShard.apply(x, tp, dim)


def gather_from_shards(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Per-rank chunks -> the full tensor along ``dim``; backward keeps this rank's gradient chunk."""
    return x if tp.size == 1 else _GatherFromShards.apply(x, tp, dim)


class _SumPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumPartialsToShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim % x.dim()
        d = ctx.dim
        if x.shape[d] % tp.size:
            raise ValueError(
                f"sum_partials_to_shard: dim {d} has size {x.shape[d]}, not divisible by tensor_parallel_size="
                f"{tp.size}; under sequence parallel pad every micro-batch to a multiple of the TP size"
            )
        return _reduce_scatter_dim(x, tp, d)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.tp, ctx.dim), None, None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _GatherSummingGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim % x.dim()
        return _all_gather_dim(x, tp, ctx.dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.tp, ctx.dim), None, None


def copy_to_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """x replicated, entering code that differs per rank (a rank's output columns): identity forward;
    backward all-reduces the gradient, the sum of every rank's partial (Megatron's copy_to_region)."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp)


def gather_summing_grads(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Per-rank chunks -> the full tensor along ``dim``, used afterwards differently by each rank
    (a rank's output columns): backward reduce-scatters, each rank's chunk of the summed gradient."""
    return x if tp.size == 1 else _GatherSummingGrads.apply(x, tp, dim)


def sum_partials(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Partial sums on every rank -> their sum on every rank; backward passes the gradient through."""
    return x if tp.size == 1 else _SumPartials.apply(x, tp)


def sum_partials_to_shard(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Partial sums on every rank -> this rank's chunk (along ``dim``) of their sum; backward all-gathers."""
    return x if tp.size == 1 else _SumPartialsToShard.apply(x, tp, dim)
