"""Gradient-norm clipping across every mesh dimension, without a host sync.

Parameters live on different meshes (FSDP shards, TP shards, EP experts on the EP mesh) and,
under pipeline parallelism, on different ranks altogether. Why not one ``full_tensor()`` per
parameter: that is one all-reduce per parameter (723 for a 70B model), each a round trip. Instead
the parameters are grouped by (mesh, the mesh dims their gradient is sharded over); each group's
local squared norms come from one ``torch._foreach_norm`` and are summed on the device, then
all-reduced once per sharded mesh dim. Replicated dims need no sum (every rank holds the same
values). Plain tensors are whole on this rank. Pipeline stages hold disjoint parameters, so the
squares are finally summed over the pipeline group. Everything stays on the compute device: the
clip coefficient is applied as a device tensor, so no rank waits for the norm.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_key(param: torch.Tensor):
    """(mesh, sharded mesh dims) of a DTensor parameter (its gradient has the same layout); None if plain."""
    if not isinstance(param, DTensor):
        return None
    dims = []
    for dim, placement in enumerate(param.placements):
        # Anything but Replicate splits the tensor over this dim: Shard, and also _StridedShard
        # (FSDP over TP), which newer torch no longer derives from Shard.
        if not placement.is_replicate():
            dims.append(dim)
    return (param.device_mesh, tuple(dims))


def _local(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor):
        if any(p.is_partial() for p in grad.placements):
            raise ValueError("a gradient is a Partial DTensor (an unreduced sum); reduce it before clipping")
        return grad.to_local()
    return grad


def squared_grad_norm(params, pp_group=None) -> torch.Tensor:
    """Sum over every parameter of ||grad||², over all ranks; an fp32 device scalar.

    Groups come from the parameters, not from which gradients exist, so every rank of a group
    issues the same collectives even where one holds no gradient (a missing gradient counts 0).
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters to clip")
    device = params[0].device
    groups: dict = defaultdict(list)
    for p in params:
        grads = groups[_group_key(p)]
        if p.grad is not None:
            grads.append(_local(p.grad))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        if grads:
            norms = torch._foreach_norm([g if g.dtype == torch.float32 else g.float() for g in grads])
            sq = torch.stack(norms).square().sum()
        else:
            sq = torch.zeros((), dtype=torch.float32, device=device)
        if key is not None:
            mesh, dims = key
            for dim in dims:
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total


@torch.no_grad()
def total_grad_norm(params, pp_group=None) -> torch.Tensor:
    return squared_grad_norm(params, pp_group).sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None, counted=None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0 or less: no clipping).

    ``counted``: the parameters the norm is taken over (default ``params``); all of ``params`` are
    scaled. Why: a weight held twice (a tied embedding's copy on the last pipeline stage) is scaled
    with its twin but counted once. Returns the norm before clipping as a device tensor (read it
    once, after the optimizer step).
    """
    params = list(params)
    norm = total_grad_norm(params if counted is None else counted, pp_group)
    if max_norm > 0:
        # The same coefficient as torch.nn.utils.clip_grad_norm_, as a device tensor.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict = defaultdict(list)
        for p in params:
            if p.grad is None:
                continue
            local = _local(p.grad)
            by_dtype[(local.device, local.dtype)].append(local)
        for grads in by_dtype.values():
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
