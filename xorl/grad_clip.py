"""Gradient-norm clipping across every mesh dimension.

Parameters live on different meshes (FSDP shards, TP shards, EP experts on the EP mesh) and,
under pipeline parallelism, on different ranks altogether. The total norm is assembled from the
squared norm of each parameter's gradient: a DTensor's norm is already global over its own mesh;
a plain tensor is whole on this rank (expert weights under EP are DTensors of global shape
[E, ...] sharded over "ep", so they are covered by the first case). Pipeline stages hold disjoint
parameters, so the squares are summed over the pipeline group. Every rank then scales by the
same factor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _squared_norm(params) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq += norm.double().cpu() ** 2
    return sq


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


@torch.no_grad()
def total_grad_norm(params, pp_group=None) -> torch.Tensor:
    return _sum_over(_squared_norm(params), pp_group).sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None) -> float:
    params = [p for p in params if p.grad is not None]
    norm = total_grad_norm(params, pp_group)
    if max_norm > 0 and torch.isfinite(norm):
        scale = min(1.0, max_norm / (float(norm) + 1e-6))
        if scale < 1.0:
            for p in params:
                p.grad.mul_(scale)
    return float(norm)
