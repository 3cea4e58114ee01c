"""LoRA adapters, built into the linear layers from the start (``model.lora``).

    model:
      lora: {rank: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, k_proj, v_proj, o_proj]}

A targeted projection is an ``xorl.nn.Linear(..., lora=LoRASpec)`` from construction on (no module
is swapped in later, ``forward`` is never replaced): it holds the frozen base ``weight`` (and bias)
and two trainable parameters ``lora_A`` [rank, in] and ``lora_B`` [out, rank], and computes

    y = x W^T + b + scaling * dropout(x) A^T B^T,   scaling = alpha / rank

exactly as peft's ``LoraLayer`` does (dropout on the adapter's input only; A kaiming-uniform with
a = sqrt(5), B zero, so the first step's model is the base model). The tensor-parallel linears
(xorl/nn/tensor_parallel.py) carry the same adapters, split to match their base (see there).
With LoRA on, every other parameter of the model is frozen (``freeze_base``): no gradient, no
optimizer state (xorl/trainer/optim.py's groups take only ``requires_grad`` parameters).

Names: the adapter of module ``P`` is ``P.lora_A`` / ``P.lora_B`` in xorl's state dict, and
``base_model.model.P.lora_A.weight`` in peft's adapter_model.safetensors (xorl/checkpoint/peft_adapter.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xorl_kernels.expert_gemm.op import grouped_gemm

# The module names a LoRA target may use: the attention and dense-MLP projections (HF names).
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAMES = ("lora_A", "lora_B")
# Families whose experts may take adapters (``experts``): transformers holds their experts as
# ``mlp.experts.{gate_up_proj, down_proj}``, which peft adapts (xorl/checkpoint/peft_adapter.py); each is checked
# against peft by tests/unit/nn/test_lora.py. A new MoE family is refused until it is added here and there.
EXPERT_LORA_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe")
LORA_KEYS = ("rank", "alpha", "dropout", "target_modules", "init_lora_weights")
# peft's shorthand for "every nn.Linear but the output layer": on a dense family exactly LINEAR_TARGETS
# (tests/unit/nn/test_lora.py resolves it with peft); on an MoE family peft's set depends on how transformers
# builds its router and shared experts, so there it is refused and the names must be listed.
ALL_LINEAR = "all-linear"


def expand_all_linear(lora: dict | None, num_experts: int) -> dict | None:
    """``model.lora`` with ``target_modules: all-linear`` (or ``[all-linear]``) written out as the dense
    projections on a dense model; anything else unchanged (xorl/config/rules/lora.py judges it)."""
    if not lora or num_experts or lora.get("target_modules") not in (ALL_LINEAR, [ALL_LINEAR]):
        return lora
    return {**lora, "target_modules": list(LINEAR_TARGETS)}


@dataclass(frozen=True)
class LoRASpec:
    """One projection's adapter: rank r, scaling alpha / r, dropout on its input; ``init_lora_weights``
    as peft's: True = B zero (the step-0 model is the base), False = B drawn too (tests only)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    init_lora_weights: bool = True

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_spec(lora: dict | None, module_name: str) -> LoRASpec | None:
    """The adapter ``model.lora`` puts on projection ``module_name`` (e.g. "q_proj"), or None."""
    if not lora or module_name not in lora.get("target_modules", ()):
        return None
    return LoRASpec(int(lora["rank"]), float(lora.get("alpha", lora["rank"])), float(lora.get("dropout", 0.0)),
                    bool(lora.get("init_lora_weights", True)))


def adapter_identity(lora: dict | None) -> tuple | None:
    """What ``model.lora`` builds and trains, with its defaults filled and its targets as a set: two
    settings with the same identity are the same adapter (a resume compares these, so writing
    ``dropout: 0.0`` or listing the targets in another order is not a change)."""
    if not isinstance(lora, dict):
        return lora
    targets = lora.get("target_modules")
    return (lora.get("rank"), float(lora.get("alpha", lora.get("rank") or 0)), float(lora.get("dropout", 0.0)),
            bool(lora.get("init_lora_weights", True)),
            frozenset(targets) if isinstance(targets, list) else targets)


def adapter_architecture(lora: dict | None) -> tuple | None:
    """What the trained adapter weights mean: rank, alpha (their scaling) and the targets. Dropout
    (a training knob) and init_lora_weights (the initial values a resume replaces) are not part of it."""
    identity = adapter_identity(lora)
    return identity if not isinstance(identity, tuple) else (identity[0], identity[1], identity[4])


def is_adapter_name(name: str) -> bool:
    """True for an adapter parameter's name (``...q_proj.lora_A``)."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def adapter_bounds(spec: LoRASpec, in_features: int) -> dict[str, float | None]:
    """The uniform bounds of A and B's initialisation (None: zeros), peft's: A kaiming-uniform with
    a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zero, or with init_lora_weights=False nn.Linear's
    default for [out, rank], U(-1/sqrt(rank), 1/sqrt(rank))."""
    return {"lora_A": 1.0 / math.sqrt(in_features),
            "lora_B": None if spec.init_lora_weights else 1.0 / math.sqrt(spec.rank)}


def make_adapters(spec: LoRASpec, a_shape, b_shape, device, dtype, wrap=None
                  ) -> tuple[nn.Parameter, nn.Parameter, nn.Module]:
    """A layer's ``lora_A``, ``lora_B`` (uninitialised; ``wrap`` turns a local tensor into the
    parameter's data, e.g. a DTensor of the TP mesh) and its input dropout, for its constructor."""
    a = torch.empty(a_shape, device=device, dtype=dtype)
    b = torch.empty(b_shape, device=device, dtype=dtype)
    # The dropout is a module (not a functional call) so model.train() / eval() switch it as peft's does.
    return (nn.Parameter(wrap("lora_A", a) if wrap else a), nn.Parameter(wrap("lora_B", b) if wrap else b),
            nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity())


def freeze_base(model: nn.Module) -> None:
    """Every parameter but the adapters stops taking gradients (the base model of a LoRA run)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))


def frozen_dtype(lora, compute_dtype: str) -> torch.dtype | None:
    """The dtype a LoRA run (``lora``: model.lora) stores its frozen base in (None: as built, fp32): the
    run's compute dtype (xorl.config.compute_dtype, passed in: this module does not import the config)."""
    if lora and compute_dtype == "bfloat16":
        return torch.bfloat16
    return None


def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen (base) parameters in ``dtype``; returns how many were cast.

    Why: under bf16 compute (FSDP2's mixed precision on GPU) the base is only ever read in bf16, and
    a frozen weight has no updates to accumulate, so an fp32 master copy would only double its memory.
    The adapters keep fp32 master weights (FSDP2 asks a uniform dtype of the trainable parameters of
    a unit only). Run on the model just built (meta device), before any plan: tied weights stay tied.
    """
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in memo:
                memo[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module._parameters[name] = memo[id(param)]
    return len(memo)


def check_targets_built(model: nn.Module, lora: dict) -> None:
    """Every name of ``target_modules`` got an adapter somewhere: a target no module of this model
    builds with one (e.g. a family whose attention does not take adapters) is an error, never a
    silently smaller fine-tune. xorl/config/validate.py refuses the known cases before launch."""
    built = set()
    for name, module in model.named_modules():
        if isinstance(module, ExpertsLoRA):
            built.add("experts")
        elif getattr(module, "lora", None) is not None:
            built.add(name.rpartition(".")[2])
    missing = [t for t in lora["target_modules"] if t not in built]
    if missing:
        raise ValueError(f"model.lora.target_modules {missing}: no module of this model takes a LoRA adapter under "
                         f"that name (adapted: {sorted(built)}); remove them")


def adapter_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """dropout(x), what A multiplies (peft: lora_A(dropout(x)))."""
    return module.lora_dropout(x)


def lora_delta(module: nn.Module, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """scaling * dropout(x) A^T B^T, in peft's order (A first: the rank-r tensor is the small one)."""
    return F.linear(F.linear(adapter_input(module, x), a), b) * module.lora.scaling


class ExpertsLoRA(nn.Module):
    """Per-expert adapters of one stacked expert weight [E, in, out] (``experts`` in target_modules).

    ``lora_A`` [E, in, r] and ``lora_B`` [E, r, out], in the grouped GEMM's [groups, in, out] layout, so
    the adapter runs as two grouped GEMMs over the same expert-sorted rows as the base:
    ``delta = scaling * grouped_gemm(grouped_gemm(x, A), B)``, per expert ``x A_e B_e`` (peft's
    per-expert ``B_e A_e`` on the transposed weight). Expert parallelism shards both on dim 0 as it
    shards the base (``GroupedExperts.distribute_over``). No dropout (peft refuses it on experts too:
    the delta is applied to the weight there).
    """

    def __init__(self, spec: LoRASpec, num_experts: int, in_features: int, out_features: int, device=None,
                 dtype=None):
        super().__init__()
        self.lora, self.in_features, self.out_features = spec, in_features, out_features
        self.lora_A = nn.Parameter(torch.empty(num_experts, in_features, spec.rank, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(num_experts, spec.rank, out_features, device=device, dtype=dtype))
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        if self.lora_A.device.type == "meta":
            return
        for name, bound in adapter_bounds(self.lora, self.in_features).items():
            param = getattr(self, name)
            param.zero_() if bound is None else param.uniform_(-bound, bound)

    def keep_experts(self, shard) -> None:
        """Expert parallelism (``GroupedExperts.distribute_over``): keep ``shard(lora_A)`` and
        ``shard(lora_B)``, this rank's experts of both, as the base weights keep theirs."""
        self.lora_A, self.lora_B = shard(self.lora_A), shard(self.lora_B)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor, local) -> torch.Tensor:
        """``local``: the parameter -> this rank's experts (GroupedExperts' ``_local``)."""
        xa = grouped_gemm(x_sorted, local(self.lora_A), tokens_per_expert)
        return grouped_gemm(xa, local(self.lora_B), tokens_per_expert) * self.lora.scaling

    def extra_repr(self) -> str:
        return f"experts={self.lora_A.shape[0]}, in={self.in_features}, out={self.out_features}, rank={self.lora.rank}"


@torch.no_grad()
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A (peft's ``merge``), computed in fp32 and returned in W's dtype; stacked experts
    ([E, in, out] with A [E, in, r], B [E, r, out]): W + scaling * A B per expert."""
    if weight.dim() == 3:
        return (weight.float() + scaling * torch.bmm(a.float(), b.float())).to(weight.dtype)
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
