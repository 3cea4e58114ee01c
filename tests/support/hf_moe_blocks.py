"""Test helper: an ``xorl.nn.MoE`` from a sparse-MoE block of ``transformers`` (or the tests' own
reference block), copying its weights; and the replacement of such blocks inside a transformers model.

It lived in the library (xorl/nn/moe_convert.py, ``MoE.from_block``, and a conversion step inside
``apply_expert_parallel``), but only tests reached it: xorl trains its own models (xorl/models), which
read transformers checkpoints through xorl/models/hf_reader.py. Tests keep it to check xorl's MoE
block against transformers' Qwen3-MoE / Qwen2-MoE blocks computed by transformers' own code.

    moe = moe_from_block(block)                      # same weights; forward returns (out, aux)
    names = replace_sparse_moe_blocks(hf_model)      # every foreign block -> OutputOnlyMoE, in place

Supported layouts (the expert weights are read as [E, in, out], the xorl layout):

* xorl layout (xorl.nn.MoE's GroupedExperts): ``experts.gate_up_proj`` [E, hidden, 2I] (gate columns,
  then up) and ``experts.down_proj`` [E, I, hidden]; the reference block in tests/support/moe_reference.py
  holds ``experts.gate_proj`` / ``up_proj`` [E, hidden, I] and the same ``down_proj``; ``gate`` a Linear
  or router with ``weight`` [E, hidden].
* ``transformers`` >= 5 (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock): ``experts.gate_up_proj``
  [E, 2I, hidden] (gate rows first, then up; [out, in]) and ``experts.down_proj`` [E, hidden, I].
* ``transformers`` 4.x: ``experts`` a ModuleList of MLPs with Linear ``gate_proj`` / ``up_proj`` /
  ``down_proj`` ([out, in] weights).

Router settings are looked up on the block, its ``gate`` and its ``config`` (``top_k`` or
``num_experts_per_tok``; ``norm_topk_prob``; ``scoring``; ``aux_loss_coef`` / ``z_loss_coef``); a
Qwen2-MoE shared expert is picked up when present.
"""

from __future__ import annotations

import torch
from torch import nn

from xorl.nn.moe import MoE
from xorl.nn.moe_experts import GroupedExperts

_MISSING = object()


def _lookup(block: nn.Module, names: tuple[str, ...]):
    for owner in (block, getattr(block, "gate", None), getattr(block, "config", None)):
        if owner is None:
            continue
        for name in names:
            value = getattr(owner, name, _MISSING)
            if value is not _MISSING and not isinstance(value, (nn.Module, torch.Tensor)):
                return value
    return _MISSING


def _expert_weights(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(experts, nn.ModuleList):  # transformers 4.x: one MLP per expert, Linear [out, in]
        stack = lambda name: torch.stack([getattr(e, name).weight.detach().t() for e in experts])
        return stack("gate_proj"), stack("up_proj"), stack("down_proj")
    if isinstance(experts, GroupedExperts):  # xorl: fused [E, hidden, 2I] and [E, I, hidden]
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=2)
        return gate, up, experts.down_proj.detach()
    if hasattr(experts, "gate_up_proj"):  # transformers 5: fused [E, 2I, hidden] and [E, hidden, I]
        gate_up = experts.gate_up_proj.detach()
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter].transpose(1, 2)
        up = gate_up[:, inter:].transpose(1, 2)
        return gate, up, experts.down_proj.detach().transpose(1, 2)
    if all(hasattr(experts, n) for n in ("gate_proj", "up_proj", "down_proj")):  # the reference block
        return experts.gate_proj.detach(), experts.up_proj.detach(), experts.down_proj.detach()
    raise TypeError(
        f"unrecognised experts module {type(experts).__name__}: expected xorl's GroupedExperts, stacked "
        "gate_proj/up_proj/down_proj, gate_up_proj/down_proj (transformers 5) or a ModuleList of MLPs (transformers 4)"
    )


def describe_block(block: nn.Module) -> dict:
    """MoE constructor keyword arguments for ``block`` plus ``_weights`` (the tensors to copy)."""
    if not hasattr(block, "gate") or not hasattr(block, "experts"):
        raise TypeError(f"{type(block).__name__} is not a sparse-MoE block (needs .gate and .experts)")
    gate, up, down = _expert_weights(block.experts)
    router_weight = block.gate.weight.detach()
    num_experts, hidden_size, inter = gate.shape
    if router_weight.shape != (num_experts, hidden_size):
        raise ValueError(f"gate.weight is {tuple(router_weight.shape)}, expected ({num_experts}, {hidden_size})")
    spec: dict = {"hidden_size": hidden_size, "num_experts": num_experts, "moe_intermediate_size": inter}
    top_k = _lookup(block, ("top_k", "num_experts_per_tok"))
    if top_k is not _MISSING:
        spec["top_k"] = int(top_k)
    norm = _lookup(block, ("norm_topk_prob",))
    if norm is not _MISSING:
        spec["norm_topk_prob"] = bool(norm)
    scoring = _lookup(block, ("scoring", "router_scoring", "scoring_func", "score_func"))  # others' names too
    if scoring is not _MISSING:
        spec["scoring"] = str(scoring)
    for ours, names in (
        ("aux_loss_coef", ("aux_loss_coef", "router_aux_loss_coef")),
        ("z_loss_coef", ("z_loss_coef", "router_z_loss_coef")),
    ):
        coef = _lookup(block, names)
        if coef is not _MISSING:
            spec[ours] = float(coef)
    weights = {"gate": router_weight, "gate_proj": gate, "up_proj": up, "down_proj": down}
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        weights["e_score_correction_bias"] = bias.detach()
        spec["expert_bias"] = True
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        spec["shared_expert_intermediate_size"] = shared.gate_proj.weight.shape[0]
        weights["shared_expert"] = {k: v.detach() for k, v in shared.state_dict().items()}
        weights["shared_expert_gate"] = block.shared_expert_gate.weight.detach()
    spec["_weights"] = weights
    if "top_k" not in spec:
        raise ValueError(f"could not find top_k on {type(block).__name__}; pass moe_from_block(block, top_k=...)")
    return spec


class OutputOnlyMoE(MoE):
    """An xorl MoE block in a transformers model, whose decoder layer expects the block's output alone
    (the auxiliary losses are dropped)."""

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(hidden_states, token_mask)[0]


def moe_from_block(block: nn.Module, *, cls: type[MoE] = MoE, **overrides) -> MoE:
    """An xorl MoE (``cls``) from ``block``, copying its weights. Router settings (top_k,
    norm_topk_prob) are read from the block; pass them as keyword overrides if it does not carry them."""
    spec = describe_block(block)
    spec.update(overrides)
    weights = spec.pop("_weights")
    ref = weights["gate_proj"]
    moe = cls(device=ref.device, dtype=ref.dtype, **spec)
    with torch.no_grad():
        moe.gate.weight.copy_(weights["gate"])
        moe.load_experts(weights["gate_proj"], weights["up_proj"], weights["down_proj"])
        if moe.shared_expert is not None:
            moe.shared_expert.load_state_dict(weights["shared_expert"])
            moe.shared_expert_gate.weight.copy_(weights["shared_expert_gate"])
        if moe.gate.e_score_correction_bias is not None and "e_score_correction_bias" in weights:
            moe.gate.e_score_correction_bias.copy_(weights["e_score_correction_bias"])
    moe.train(block.training)
    return moe


def is_sparse_moe_block(module: nn.Module) -> bool:
    """A foreign block with a router ``gate`` and an ``experts`` container (transformers layouts)."""
    if isinstance(module, MoE):
        return False
    experts = getattr(module, "experts", None)
    gate = getattr(module, "gate", None)
    if experts is None or gate is None or not isinstance(getattr(gate, "weight", None), nn.Parameter):
        return False
    return hasattr(experts, "gate_proj") or hasattr(experts, "gate_up_proj") or isinstance(experts, nn.ModuleList)


def replace_sparse_moe_blocks(model: nn.Module) -> list[str]:
    """Put an ``OutputOnlyMoE`` with the same weights where ``model`` has a foreign sparse-MoE block;
    returns their paths."""
    paths = [name for name, module in model.named_modules() if is_sparse_moe_block(module)]
    for path in paths:
        model.set_submodule(path, moe_from_block(model.get_submodule(path), cls=OutputOnlyMoE), strict=True)
    return paths
