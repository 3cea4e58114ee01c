"""``Linear``: nn.Linear whose GEMMs run in FP8 when the model is built with an FP8 recipe.

The models build their attention and MLP projections as this class with ``fp8=`` the run's
``train.fp8`` (through ``ModelSpec.fp8``), so the recipe is fixed at construction: no module is
swapped in later and ``forward`` is never replaced. With ``fp8="none"`` it is exactly nn.Linear.
Parameters, names and state dicts are nn.Linear's (fp32 master weights, unchanged checkpoints);
the FP8 copies exist only inside the GEMMs (xorl_kernels/fp8/linear.py). The tensor-parallel plan
carries the recipe into ColumnParallelLinear / RowParallelLinear (``from_linear``).

``lora=LoRASpec``: the layer is built with a LoRA adapter (``lora_A``, ``lora_B``; xorl/nn/lora.py),
its base weight and bias frozen; the TP plan carries the adapter into the TP linears as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xorl.nn.lora import adapter_bounds, lora_delta, make_adapters

FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise")


def check_fp8(fp8: str) -> str:
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8={fp8!r}: use one of {FP8_RECIPES} (train.fp8)")
    return fp8


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 fp8: str = "none", lora=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8 = check_fp8(fp8)
        self.lora = lora  # xorl.nn.lora.LoRASpec or None
        if lora is not None:
            self.lora_A, self.lora_B, self.lora_dropout = make_adapters(
                lora, (lora.rank, in_features), (out_features, lora.rank), self.weight.device, self.weight.dtype)
            self.reset_lora_parameters()
            for param in (self.weight, self.bias):
                if param is not None:
                    param.requires_grad_(False)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's initialisation of the adapter (xorl.nn.lora.adapter_bounds)."""
        if self.lora_A.device.type == "meta":
            return
        for name, bound in adapter_bounds(self.lora, self.in_features).items():
            param = getattr(self, name)
            param.zero_() if bound is None else param.uniform_(-bound, bound)

    def gather_weight_as(self, subclass: type[torch.Tensor]) -> None:
        """Hold the weight as ``subclass(weight.data)``: a tensor subclass whose FSDP2 all-gather
        extension casts the shard before sending it (train.fp8_all_gather: ``Float8AllGatherWeight``,
        xorl/nn/fp8_all_gather.py). Call before fully_shard; the parameter keeps its name, shape,
        dtype, values and requires_grad."""
        weight = self.weight
        self.weight = nn.Parameter(subclass(weight.data), requires_grad=weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 == "none":
            y = F.linear(x, self.weight, self.bias)
        else:
            from xorl_kernels.fp8.linear import fp8_linear

            y = fp8_linear(x, self.weight, self.bias, self.fp8)
        if self.lora is None:
            return y
        return y + lora_delta(self, x, self.lora_A, self.lora_B)

    def extra_repr(self) -> str:
        return (super().extra_repr() + ("" if self.fp8 == "none" else f", fp8={self.fp8}")
                + ("" if self.lora is None else f", lora_rank={self.lora.rank}"))
