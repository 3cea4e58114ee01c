"""The expert-parallel set-up: every MoE block keeps only its share of the experts; the routers' balance group.

    record = apply_expert_parallel(model, ep_mesh)   # ep_mesh: ParallelState.ep_mesh ("ep_fsdp", "ep")
    record = set_router_balance_group(model, group)  # the tokens load balancing is computed over
    (after each step: xorl/parallel/step_reductions.py step_router_loads: bias updates, the expert_load metric)

The xorl models build ``xorl.nn.MoE`` blocks holding all E experts (on the meta device at scale,
so nothing is allocated); ``apply_expert_parallel`` makes each keep this rank's ``E / ep`` experts
as DTensors of global shape [E, ...] sharded over the "ep" dim (``MoE.distribute_experts``), so
checkpoints (DCP) and gradient-norm clipping see every expert exactly once, and the tokens are
dispatched over the EP group. FSDP2 then shards the local experts over "ep_fsdp"
(xorl/parallel/data_parallel.py), with gradients summed like every other parameter. Only xorl's own
MoE blocks are distributed (a foreign transformers block is no xorl.nn.MoE: tests/support/hf_moe_blocks.py
converts one for the tests that compare against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from xorl.nn.moe import MoE


def _ep_dim_mesh(ep_mesh):
    """The 1-D "ep" mesh of ``ep_mesh`` (the 2-D EP mesh, or already 1-D); None stays None."""
    if ep_mesh is None:
        return None
    if isinstance(ep_mesh, dist.ProcessGroup):
        raise TypeError(
            "apply_expert_parallel takes the EP DeviceMesh (ParallelState.ep_mesh), not a process group: "
            "the experts become DTensors over its 'ep' dim"
        )
    names = getattr(ep_mesh, "mesh_dim_names", None) or ()
    if ep_mesh.ndim > 1:
        if "ep" not in names:
            raise ValueError(f"the EP mesh needs an 'ep' dim, got dims {names}")
        return ep_mesh["ep"]
    return ep_mesh


@dataclass
class ExpertParallelRecord:
    """What ``apply_expert_parallel`` did."""

    blocks: list[str]  # the MoE blocks' module names
    ep_size: int  # experts split over this many ranks (1: all local)


@dataclass
class RouterBalanceRecord:
    """What ``set_router_balance_group`` did: the group each router's balancing statistics cover."""

    group: dist.ProcessGroup | None
    routers: int


def apply_expert_parallel(model: nn.Module, ep_mesh) -> ExpertParallelRecord:
    """Make every MoE block of ``model`` expert-parallel over ``ep_mesh``; returns what was done.

    ``ep_mesh`` None (or an "ep" dim of size 1): no expert parallelism. Every rank of an EP group must
    call it on the same full weights.
    """
    ep = _ep_dim_mesh(ep_mesh)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no xorl.nn.MoE block: expert parallelism needs an MoE model built "
            "by xorl.models; set expert_parallel_size: 1 for a dense model"
        )
    if ep is not None and ep.size() > 1:
        for name, moe in targets:
            try:
                moe.distribute_experts(ep)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    return ExpertParallelRecord([name for name, _ in targets], 1 if ep is None else ep.size())


def set_router_balance_group(model: nn.Module, group: dist.ProcessGroup | None) -> RouterBalanceRecord:
    """Every router of ``model`` computes its load-balancing statistics over ``group``'s tokens."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in blocks:
        moe.set_balance_group(group)
    return RouterBalanceRecord(group, len(blocks))


