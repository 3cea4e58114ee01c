"""The experts of an MoE layer as two stacked weights and two grouped GEMMs.

Parameter names and layouts ([groups, in, out]): ``gate_up_proj`` [E, hidden, 2 * moe_intermediate]
(each expert's gate columns, then its up columns) and ``down_proj`` [E, moe_intermediate, hidden].
Why gate and up in one weight: one grouped GEMM reads the sorted rows once and launches once for
both projections (the per-expert tiles are twice as wide), and SwiGLU runs right after on its two
halves; three launches become two. ``gate_up_proj`` is transformers 5's in-memory ``gate_up_proj``
[E, 2I, hidden] transposed to the [groups, in, out] layout the grouped GEMM takes. Under expert
parallelism the module holds only this rank's ``E / ep_size`` experts (the stacked dim 0 is the
local expert index).

gpt-oss variant (``bias=True``, ``swiglu_limit`` set): per-expert biases ``gate_up_proj_bias``
[E, 2I] (gate units, then up) and ``down_proj_bias`` [E, hidden], added by the grouped GEMM, and the
clamped SwiGLU ``(up.clamp(-l, l) + 1) * g * sigmoid(alpha * g)``, ``g = gate.clamp(max=l)``.

Why a module of its own: FSDP2 (``fully_shard`` over the ep_fsdp mesh) gathers parameters in the
pre-forward hook of the module it wraps, so the expert weights must be used inside this module's
forward and nowhere else.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from xorl.nn.lora import ExpertsLoRA
from xorl_kernels.activation.op import clamped_swiglu, swiglu
from xorl_kernels.expert_gemm.op import grouped_gemm

# train.fp8 -> whether the experts' grouped GEMM runs in FP8: only blockwise has an FP8 grouped
# kernel (DeepSeek-V3's 1x128 / 128x128 scales); under tensorwise / rowwise the experts compute in
# train.dtype and only the dense projections use FP8 (README, train.fp8).
_EXPERT_FP8 = {"none": False, "tensorwise": False, "rowwise": False, "blockwise": True}


def experts_run_fp8(recipe: str) -> bool:
    """Whether train.fp8 = ``recipe`` runs the experts' grouped GEMM in FP8 (the start-up line says so)."""
    return _EXPERT_FP8[recipe]


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: the local shard when the weight is a DTensor sharded over the EP mesh
    (differentiable: the gradient comes back as a DTensor with the same placement)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def swiglu_experts(x_sorted, gate_up_proj, down_proj, tokens_per_expert, fp8: bool = False, adapters=None,
                   gate_up_bias=None, down_bias=None, swiglu_alpha: float = 1.702, swiglu_limit: float | None = None):
    """down(silu(x @ gate) * (x @ up)) per expert over rows sorted by expert: one grouped GEMM for
    gate and up together ([N, 2I]), SwiGLU on its halves, one for down. ``fp8``: blockwise FP8 GEMMs.
    ``adapters``: (gate_up, down) callables adding each projection's LoRA delta (xorl/nn/lora.py).
    gpt-oss: per-expert biases on both GEMMs and, with ``swiglu_limit``, the clamped SwiGLU."""
    if fp8:
        from xorl_kernels.fp8.grouped import fp8_grouped_gemm as gemm
    else:
        gemm = grouped_gemm
    if gate_up_bias is None:
        gate_up = gemm(x_sorted, gate_up_proj, tokens_per_expert)
    else:
        gate_up = grouped_gemm(x_sorted, gate_up_proj, tokens_per_expert, gate_up_bias)
    if adapters is not None:
        gate_up = gate_up + adapters[0](x_sorted)
    gate, up = gate_up.chunk(2, dim=-1)
    act = swiglu(gate, up) if swiglu_limit is None else clamped_swiglu(gate, up, swiglu_alpha, swiglu_limit)
    if down_bias is None:
        out = gemm(act, down_proj, tokens_per_expert)
    else:
        out = grouped_gemm(act, down_proj, tokens_per_expert, down_bias)
    return out if adapters is None else out + adapters[1](act)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts evaluated with ``xorl_kernels.expert_gemm.op``."""

    def __init__(self, num_experts: int, hidden_size: int, moe_intermediate_size: int, device=None, dtype=None,
                 fp8: str = "none", lora=None, bias: bool = False, swiglu_alpha: float = 1.702,
                 swiglu_limit: float | None = None):
        super().__init__()
        if fp8 not in _EXPERT_FP8:
            raise ValueError(f"GroupedExperts: fp8={fp8!r}; use one of {tuple(_EXPERT_FP8)}")
        if bias and _EXPERT_FP8[fp8]:
            raise ValueError(f"GroupedExperts: fp8={fp8!r} has no grouped GEMM with a bias (gpt-oss experts); "
                             "use train.fp8 none, tensorwise or rowwise")
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.fp8 = fp8
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, 2 * moe_intermediate_size, device=device, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, moe_intermediate_size, hidden_size, device=device, dtype=dtype)
        )
        # LoRA on the experts (xorl.nn.lora.LoRASpec): per-expert adapters of both stacked weights,
        # inside this module so FSDP2's unit over the experts holds them too; the base is frozen.
        if lora is not None:
            self.lora_gate_up_proj = ExpertsLoRA(lora, num_experts, hidden_size, 2 * moe_intermediate_size,
                                                 device, dtype)
            self.lora_down_proj = ExpertsLoRA(lora, num_experts, moe_intermediate_size, hidden_size, device, dtype)
            self.gate_up_proj.requires_grad_(False)
            self.down_proj.requires_grad_(False)
        else:
            self.lora_gate_up_proj = self.lora_down_proj = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(
                torch.empty(num_experts, 2 * moe_intermediate_size, device=device, dtype=dtype))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.init_weights()

    @property
    def param_names(self) -> tuple[str, ...]:
        """The stacked [E, ...] tensors (expert parallelism slices each on dim 0)."""
        biases = ("gate_up_proj_bias", "down_proj_bias") if self.gate_up_proj_bias is not None else ()
        return ("gate_up_proj", "down_proj", *biases)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=std)
        for p in (self.gate_up_proj_bias, self.down_proj_bias):
            if p is not None:
                nn.init.zeros_(p)

    def distribute_over(self, ep_mesh) -> None:
        """Keep this rank's experts as DTensors of global shape [E, ...] sharded on dim 0 over the 1-D
        EP mesh (rank r holds experts [r*E/ep, (r+1)*E/ep)). Call it on the full module (all E
        experts; on the meta device nothing is allocated). Forward uses the local shard; FSDP2 over
        the ep_fsdp dim of the same parent mesh composes with it (2-D)."""
        from torch.distributed.tensor import Shard

        if ep_mesh.ndim != 1:
            raise ValueError(f"distribute_over needs the 1-D EP mesh (ep_mesh['ep']), got a {ep_mesh.ndim}-D mesh")
        size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        if self.num_experts % size:
            raise ValueError(f"{self.num_experts} experts do not split over an EP size of {size}")
        local_n = self.num_experts // size
        first = rank * local_n

        def shard(full: torch.Tensor) -> nn.Parameter:
            # A copy of this rank's rows, so the full tensor is freed.
            local = full.detach()[first:first + local_n].clone()
            return nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False),
                                requires_grad=full.requires_grad)

        # The stacked [E, ...] tensors and, under LoRA, the adapters ([E, ...] all): each rank keeps its experts.
        adapters = [m for m in (self.lora_gate_up_proj, self.lora_down_proj) if m is not None]
        for name, full in [(n, getattr(self, n)) for n in self.param_names] + \
                [(n, getattr(m, n)) for m in adapters for n in ("lora_A", "lora_B")]:
            if isinstance(full, DTensor):
                raise RuntimeError(f"experts.{name} is already a DTensor; distribute_over runs once")
        for name in self.param_names:
            setattr(self, name, shard(getattr(self, name)))
        for adapter in adapters:
            adapter.keep_experts(shard)
        self.num_experts = local_n

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted [N, hidden] grouped by local expert, tokens_per_expert [num_experts] -> [N, hidden]."""
        if tokens_per_expert.shape != (self.num_experts,):
            raise ValueError(
                f"tokens_per_expert must be [{self.num_experts}] (one count per local expert), "
                f"got {tuple(tokens_per_expert.shape)}"
            )
        adapters = None
        if self.lora_gate_up_proj is not None:
            adapters = (lambda x: self.lora_gate_up_proj(x, tokens_per_expert, _local),
                        lambda h: self.lora_down_proj(h, tokens_per_expert, _local))
        biases = {}
        if self.gate_up_proj_bias is not None:
            biases = dict(gate_up_bias=_local(self.gate_up_proj_bias), down_bias=_local(self.down_proj_bias))
        return swiglu_experts(x_sorted, _local(self.gate_up_proj), _local(self.down_proj), tokens_per_expert,
                              fp8=_EXPERT_FP8[self.fp8], adapters=adapters, swiglu_alpha=self.swiglu_alpha,
                              swiglu_limit=self.swiglu_limit, **biases)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"moe_intermediate_size={self.moe_intermediate_size}" + ("" if self.fp8 == "none" else f", fp8={self.fp8}")
            + ("" if self.gate_up_proj_bias is None else ", bias=True")
            + ("" if self.swiglu_limit is None
               else f", swiglu_alpha={self.swiglu_alpha}, swiglu_limit={self.swiglu_limit}")
        )
