"""The expert-parallel plan: swap every sparse-MoE block of a model for ``xorl.nn.MoE`` with sharded experts.

``apply_expert_parallel(model, ep)`` walks the model and replaces each MoE block (the xorl
Qwen3-MoE reference block at ``model.layers[i].mlp``, or a ``transformers`` Qwen3-MoE / Qwen2-MoE
sparse block) by an ``xorl.nn.MoE`` holding only this rank's ``num_experts / ep_size`` experts,
copying the router, the local experts and the shared expert. ``ep`` is the EP process group or the
EP DeviceMesh (``ParallelState.ep_mesh``, dims ("ep_fsdp", "ep"); its "ep" dim is used).

Prefer the mesh: the expert weights then become DTensors of global shape [E, ...] sharded over
"ep" (``GroupedExperts.distribute_over``), so checkpoints (DCP) and gradient-norm clipping see each
expert exactly once. With a plain group they stay local [E/ep, ...] tensors that share one
parameter name across EP ranks: a DCP save would then keep only one rank's experts.

Every rank of an EP group must call it (the blocks must hold the same full weights on each rank,
e.g. loaded from the same checkpoint or initialised with the same seed). A model built on the meta
device stays on meta (nothing to copy); initialise it afterwards with ``model.init_weights()``.

``shard_experts_with_fsdp(model, ep_mesh)`` then applies FSDP2 to each MoE's ``experts`` over the
"ep_fsdp" dim, so the local experts are further sharded across the data-parallel replicas of
each EP rank (the rest of the model is sharded by the regular FSDP plan over the full DP mesh).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from xorl.nn.moe import MoE


def _ep_group(ep) -> dist.ProcessGroup | None:
    if ep is None or isinstance(ep, dist.ProcessGroup):
        return ep
    names = getattr(ep, "mesh_dim_names", None)  # a DeviceMesh
    if names and "ep" in names:
        return ep.get_group("ep")
    if getattr(ep, "ndim", None) == 1:
        return ep.get_group()
    raise TypeError(f"ep must be a ProcessGroup or a DeviceMesh with an 'ep' dim (ParallelState.ep_mesh), got {ep!r}")


def _ep_dim_mesh(ep):
    """The 1-D "ep" mesh when ``ep`` is a DeviceMesh, else None (a plain group: local tensors)."""
    if ep is None or isinstance(ep, dist.ProcessGroup):
        return None
    names = getattr(ep, "mesh_dim_names", None)
    return ep["ep"] if names and "ep" in names and ep.ndim > 1 else ep


def is_sparse_moe_block(module: nn.Module) -> bool:
    """A block with a router ``gate`` and an ``experts`` container (xorl or transformers layout)."""
    if isinstance(module, MoE):
        return False
    experts = getattr(module, "experts", None)
    gate = getattr(module, "gate", None)
    if experts is None or gate is None or not isinstance(getattr(gate, "weight", None), nn.Parameter):
        return False
    return hasattr(experts, "gate_proj") or hasattr(experts, "gate_up_proj") or isinstance(experts, nn.ModuleList)


def apply_expert_parallel(model: nn.Module, ep, **moe_overrides) -> list[str]:
    """Replace every sparse-MoE block of ``model`` in place; returns the replaced module names.

    ``moe_overrides`` are passed to ``MoE.from_block`` (e.g. ``aux_loss_coef``, ``expert_bias``).
    """
    group = _ep_group(ep)
    ep_dim_mesh = _ep_dim_mesh(ep)
    ep_size = 1 if group is None else dist.get_world_size(group)
    targets = [(name, module) for name, module in model.named_modules() if is_sparse_moe_block(module)]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no sparse-MoE block (a module with .gate and .experts): "
            "expert parallelism needs an MoE model; set expert_parallel_size: 1 for a dense model"
        )
    replaced = []
    for name, block in targets:
        moe = MoE.from_block(block, ep_group=group, **moe_overrides)
        if ep_dim_mesh is not None and ep_size > 1:
            moe.experts.distribute_over(ep_dim_mesh)
        if moe.num_experts % ep_size:  # MoE checks too; this names the layer
            raise ValueError(f"{name}: num_experts={moe.num_experts} is not divisible by EP size {ep_size}")
        moe.train(block.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, moe)
        replaced.append(name)
    return replaced


def shard_experts_with_fsdp(
    model: nn.Module, ep_mesh, gradient_divide_factor: float | None = None, **fsdp_kwargs
) -> int:
    """``fully_shard`` every ``xorl.nn.MoE``'s experts over ``ep_mesh["ep_fsdp"]``; returns how many.

    Gradient scale: an expert's gradient sums the contributions of the tokens of all
    ep_fsdp x ep ranks (the all_to_all brings them to its owner), while FSDP over ep_fsdp alone
    would divide by ep_fsdp only. To match the data-parallel mean that the rest of the model gets,
    the reduce-scatter divides by ``gradient_divide_factor``, default ep_fsdp * ep (the number of
    data-parallel ranks whose tokens reach these experts; torchtitan does the same).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = ep_mesh["ep_fsdp"]
    if gradient_divide_factor is None:
        gradient_divide_factor = float(ep_mesh.size())
    count = 0
    for module in model.modules():
        if isinstance(module, MoE):
            fully_shard(module.experts, mesh=mesh, **fsdp_kwargs)
            module.experts.set_gradient_divide_factor(gradient_divide_factor)
            if mesh.device_type == "cpu":
                # A custom factor means PREMUL_SUM, which gloo lacks: sum, then divide separately.
                module.experts.set_force_sum_reduction_for_comms(True)
            count += 1
    return count
