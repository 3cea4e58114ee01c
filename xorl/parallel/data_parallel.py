"""The data-parallel set-up: FSDP2 / HSDP sharding per decoder block, the experts on their own mesh.

    apply_fsdp(model, state, reshard_after_forward, bf16_compute, float8_all_gather)  # FSDP2 per block, then the root
    (returns an FSDPRecord: what it did)

Gradients are SUMMED across data-parallel ranks (FSDP's divide factor 1): the loss is already
normalised by the global token count (xorl/trainer/loss.py), so averaging again would scale
gradients by 1/dp. data_parallel_mode ddp sums them each step instead
(xorl/parallel/step_reductions.py all_reduce_gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [layer for layer in model.model.layers if layer is not None]


@dataclass
class FSDPRecord:
    """What ``apply_fsdp`` did: the meshes the parameters are sharded over (FSDP reduces their
    gradients itself, in backward)."""

    mesh: object  # the blocks' and the root's DeviceMesh
    expert_mesh: object | None  # the experts' own mesh, or None when they share the blocks'
    reshard_after_forward: bool
    float8_all_gather: bool = False  # the tensorwise-FP8 linears' weights are gathered in float8


def apply_fsdp(model: nn.Module, state, reshard_after_forward: bool = True, bf16_compute: bool = False,
               float8_all_gather: bool = False) -> FSDPRecord:
    """FSDP2 per block, then the root; expert weights on their own EP-FSDP mesh (dp_shard x CP x TP / EP).

    HSDP when the FSDP mesh has a replicate dim (data_parallel_replicate_size > 1). Gradients are
    SUMMED across ranks (divide factor 1): the loss is already normalised by the global token count
    (xorl/trainer/loss.py), so averaging again would scale gradients by 1/dp.
    ``float8_all_gather`` (train.fp8_all_gather): the tensorwise-FP8 linears' weights are gathered
    as float8 (xorl/nn/fp8_all_gather.py).
    """
    if float8_all_gather:
        from xorl.nn.fp8_all_gather import cast_weights_for_float8_all_gather

        cast_weights_for_float8_all_gather(model)
    mesh = state.fsdp_mesh
    kw = {"reshard_after_forward": reshard_after_forward}
    if bf16_compute:  # bf16 compute, fp32 master weights and fp32 gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Experts get their own mesh whenever it differs from the blocks': under EP, and under TP, where
    # each TP rank's MoE block routes its own token shard (expert gradients are partial over TP).
    expert_mesh = _expert_fsdp_mesh(state) if experts_have_own_mesh(state) else None
    for layer in decoder_layers(model):
        experts = getattr(getattr(_unwrap(layer), "mlp", None), "experts", None)
        if experts is not None and expert_mesh is not None:
            fully_shard(experts, mesh=expert_mesh, **kw)
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_gradients(module)
    return FSDPRecord(mesh, expert_mesh, reshard_after_forward, float8_all_gather)


def experts_have_own_mesh(state) -> bool:
    """Expert weights are FSDP-sharded over "ep_fsdp" (dp_shard x CP x TP / EP) unless that is the
    blocks' FSDP mesh (no EP, no TP)."""
    return state.ep_size > 1 or state.tp_size > 1


def _expert_fsdp_mesh(state):
    """Experts are sharded over "ep_fsdp" and, under HSDP, replicated over dp_replicate."""
    if state.dp_replicate_size > 1:
        from xorl._torch_compat import concatenate_meshes

        return concatenate_meshes([state.dp_replicate_mesh, state.ep_fsdp_mesh])
    return state.ep_fsdp_mesh


def _unwrap(layer: nn.Module) -> nn.Module:
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _sum_gradients(module: FSDPModule) -> None:
    module.set_gradient_divide_factor(1.0)
    # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL's zero-copy path wants SUM too.
    module.set_force_sum_reduction_for_comms(True)


