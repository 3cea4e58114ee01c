"""A plain, correct MoE block: top-k router + stacked SwiGLU experts, one loop over experts.

Parameter layout (shared with the fast ``xorl.nn.MoE`` so either can be swapped in):
    gate.weight          [num_experts, hidden]                   (router, nn.Linear without bias)
    experts.gate_proj    [num_experts, hidden, moe_intermediate]  ([groups, in, out], the layout
    experts.up_proj      [num_experts, hidden, moe_intermediate]   xorl_kernels.expert_gemm.op takes)
    experts.down_proj    [num_experts, moe_intermediate, hidden]
    shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight   (optional, Qwen2-MoE:
                         out += sigmoid(shared_expert_gate(x)) * shared_expert(x))

Routing (as transformers' Qwen3-MoE): scores = softmax(router_logits) in fp32 (or sigmoid with
router_scoring="sigmoid"), top-k of the scores, optionally renormalised to sum to 1
(norm_topk_prob), cast back to the logits' dtype.

Router losses: kept on the block (``xorl.nn.MoE`` returns them instead, as ``(hidden, aux)``; this
oracle keeps the older protocol, compared by tests/unit/models/test_hf_parity.py). After each forward
the block sets
    last_aux_loss  aux_loss_coef * load_balancing_loss + z_loss_coef * z_loss  (differentiable scalar)
    last_stats     detached {"load_balancing_loss", "z_loss", "tokens_per_expert" [E] int64}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xorl.models.layers import SwiGLUMLP


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k], topk_ids [T, k], scores [T, E] in fp32).

    topk_weights come back in the logits' dtype, as in transformers."""
    if scoring == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"scoring={scoring!r}: use 'softmax' or 'sigmoid'")
    topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids, scores


def router_losses(
    router_logits: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(load_balancing_loss, z_loss, tokens_per_expert) of one MoE layer over all T tokens of the call.

    load_balancing_loss = E * sum_e f_e * P_e (Switch Transformer, Megatron normalisation), with
    f_e = (number of top-k slots routed to e) / (T * k) and P_e = mean over tokens of the normalised
    score of e; uniform routing gives 1. transformers' load_balancing_loss_func (one layer) returns
    k times this value.
    z_loss = mean over tokens of logsumexp(router_logits)^2 (ST-MoE), in fp32.
    """
    flat_ids = topk_ids.reshape(-1)
    # scatter_add rather than bincount: no device-to-host sync.
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    tokens_per_expert.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    probs = scores / scores.sum(dim=-1, keepdim=True)  # identity for softmax; normalises sigmoid scores
    fraction_routed = tokens_per_expert.float() / max(flat_ids.numel(), 1)
    load_balancing_loss = num_experts * torch.sum(fraction_routed * probs.mean(dim=0))
    z_loss = torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()
    return load_balancing_loss, z_loss, tokens_per_expert


class ReferenceExperts(nn.Module):
    """Stacked SwiGLU experts, computed one expert at a time (plain matmuls)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))

    def init_weights(self, std: float) -> None:
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids/topk_weights [T, k] -> sum_k weight * expert(x) [T, H]."""
        top_k = topk_ids.shape[1]
        token_of_slot = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)
        expert_of_slot = topk_ids.reshape(-1)
        weight_of_slot = topk_weights.reshape(-1)
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            # Experts that receive no token still run on 0 rows, so every expert gets a (zero) gradient.
            slots = (expert_of_slot == expert).nonzero().squeeze(1)
            tokens = token_of_slot[slots]
            xe = x[tokens]
            hidden = F.silu(xe @ self.gate_proj[expert]) * (xe @ self.up_proj[expert])
            ye = (hidden @ self.down_proj[expert]) * weight_of_slot[slots, None]
            out.index_add_(0, tokens, ye.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        e, h, i = self.gate_proj.shape
        return f"num_experts={e}, hidden={h}, intermediate={i}"


class ReferenceMoE(nn.Module):
    """forward(hidden [b, s, h]) -> [b, s, h]; sets ``last_aux_loss`` / ``last_stats`` (module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool = False,
        scoring: str = "softmax",
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        shared_expert_intermediate_size: int = 0,
    ):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.scoring = scoring
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = ReferenceExperts(num_experts, hidden_size, intermediate_size)
        if shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLUMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_stats: dict[str, torch.Tensor] = {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        router_logits = self.gate(x)
        topk_weights, topk_ids, scores = route(router_logits, self.top_k, self.norm_topk_prob, self.scoring)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        lb_loss, z_loss, tokens_per_expert = router_losses(router_logits, scores, topk_ids, self.num_experts)
        self.last_aux_loss = self.aux_loss_coef * lb_loss + self.z_loss_coef * z_loss
        self.last_stats = {
            "load_balancing_loss": lb_loss.detach(),
            "z_loss": z_loss.detach(),
            "tokens_per_expert": tokens_per_expert,
        }
        return out.view_as(hidden)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, scoring={self.scoring}"


def tiny_qwen3_moe_config(**overrides):
    """A transformers Qwen3-MoE config small enough for CPU tests (2 layers, hidden 32, 4 heads of
    8, experts 16 wide, top-2); ``overrides`` set the vocabulary, the expert count and the rest."""
    import transformers

    kwargs = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
                  norm_topk_prob=True, initializer_range=0.2)
    kwargs.update(overrides)
    return transformers.Qwen3MoeConfig(**kwargs)
