"""``train.fp8_all_gather``: FSDP2 all-gathers the tensorwise-FP8 linears' weights in float8.

    cast_weights_for_float8_all_gather(model)   # before fully_shard (xorl/parallel/data_parallel.py)

Each weight of an ``xorl.nn.linear.Linear`` built with ``fp8="tensorwise"`` becomes a
``Float8AllGatherWeight`` (through the linear's own ``gather_weight_as``): a tensor subclass
wrapping the unchanged fp32 (or bf16) master weight, which FSDP2 shards like any parameter (a
DTensor whose local tensor is the subclass) and whose all-gather runs through FSDP2's extension
hooks:

- ``fsdp_pre_all_gather``: the local shard's amax, all-reduced (MAX) over the FSDP shard group on
  the compute device (a functional collective, no host sync), gives the scale of the WHOLE weight;
  the shard is cast to e4m3 with it (``xorl_kernels.fp8.quantize.cast_with_amax``, the same cast
  as the un-sharded path), so the gathered bytes are exactly the un-sharded cast: 1 byte per
  element where bf16 sends 2;
- ``fsdp_post_all_gather``: the gathered bytes and the scale become torchao's
  ``Float8TrainingTensor``, whose bytes and scale the linear's GEMMs take as their weight operand as
  they are (``xorl_kernels.fp8.linear.weight_operand``; the input gradient uses its transpose): a
  torch_dispatch rule (``register_float8_weight_kernels``, registered by
  ``cast_weights_for_float8_all_gather``) hands them to the FP8 ops, eager and in a compiled block.

Master weights, optimizer state, gradients (reduce-scattered in their usual dtype) and
checkpoints are unchanged: every op other than FSDP's own shard handling unwraps the subclass.

Why not torchao's own ``WeightWithDynamicFloat8CastTensor`` (the same hooks): its cast rounds
nothing to a power of 2 (xorl's tensorwise recipe does, so that the dequantisation is exact and
equals the recipe's numbers whether or not the weight was all-gathered in float8), it casts the
master weight before the mixed-precision cast (xorl casts what the GEMM would have seen), and it
pads nothing for unevenly sharded weights. What serves is used: torchao's scale arithmetic and its
``Float8TrainingTensor`` for the gathered weight.

Only tensorwise scaling can be all-gathered so: a per-row or per-block scale computed on a shard
is not the scale of the whole weight's row or block under every shard layout (config_rules refuses
the other recipes, fp8 none and runs without FSDP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch._prims_common import suggest_memory_format

from xorl_kernels.fp8.quantize import E4M3, cast_with_amax

# FSDP2 pads, slices, views and copies a parameter's local tensor while it shards it, and moves it
# between devices: those keep the subclass, so the sharded local tensor still has the hooks.
# Everything else (the optimizer, clipping, state dicts) computes on the plain master weight.
_KEEP_SUBCLASS = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.detach.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A master weight whose FSDP2 all-gather sends its tensorwise e4m3 cast (module docstring)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            memory_format=suggest_memory_format(tensor), dtype=tensor.dtype, layout=tensor.layout,
            device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"])

    def __reduce_ex__(self, protocol):
        # Pickles (torch.save, DCP's shard files) as the plain master weight: a checkpoint of an
        # fp8_all_gather run is the run's without it, loadable by any run and by weights_only loads.
        return self._tensor.__reduce_ex__(protocol)

    def __repr__(self):
        return f"Float8AllGatherWeight({self._tensor})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        import torch.distributed._functional_collectives as funcol

        shard = self._tensor
        if mp_policy is not None and mp_policy.param_dtype is not None:
            shard = shard.to(mp_policy.param_dtype)  # cast what the GEMM would have been given
        amax = shard.abs().amax() if shard.numel() else shard.new_zeros(())
        amax = funcol.all_reduce(amax.float(), "max", mesh.get_group()).wait()
        data, qscale = cast_with_amax(shard, amax, E4M3)
        # An unevenly sharded weight: every rank sends the padded shard size (zeros, as FSDP pads).
        pad_rows = -(-outer_size[0] // mesh.size()) - data.shape[0]
        if pad_rows:
            data = F.pad(data.view(torch.uint8), (0, 0, 0, pad_rows)).view(data.dtype)
        return (data,), (qscale,)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig

        (data,), (qscale,) = all_gather_outputs, metadata
        if out is not None:  # FSDP reuses the gathered parameter: its bytes were gathered in place
            out._scale = qscale
            return None
        gathered = Float8TrainingTensor(data, qscale, param_dtype, LinearMMConfig(),
                                        gemm_input_role=GemmInputRole.WEIGHT)
        return gathered, (data,)


def float8_all_gather_linears(model: nn.Module) -> list[nn.Module]:
    """The linears whose weights ``train.fp8_all_gather`` gathers in float8: xorl's tensorwise-FP8
    ``Linear`` (attention and MLP projections; lm_head, router and experts are other modules)."""
    from xorl.nn.linear import Linear

    return [m for m in model.modules() if isinstance(m, Linear) and m.fp8 == "tensorwise"]


def cast_weights_for_float8_all_gather(model: nn.Module) -> int:
    """Give each tensorwise-FP8 linear's weight the float8 all-gather hooks (before fully_shard);
    returns how many weights. The parameter keeps its name, shape, dtype and values."""
    from xorl_kernels.fp8.linear import register_float8_weight_kernels

    linears = float8_all_gather_linears(model)
    if linears:
        register_float8_weight_kernels()
    for linear in linears:
        linear.gather_weight_as(Float8AllGatherWeight)
    return len(linears)
