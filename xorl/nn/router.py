"""Top-k token router for mixture-of-experts layers.

Scores are computed in fp32 (softmax as in Qwen/Mixtral, or sigmoid as in DeepSeek-V3), the top-k
experts are picked per token, and the top-k weights are optionally renormalised to sum to one.
Two auxiliary losses are computed on every forward and returned unscaled:

* load balancing (Switch Transformer, Megatron convention)::

      lb = E * sum_e f_e * P_e,   f_e = (#slots routed to e) / (T * K),  P_e = mean_t p[t, e]

  where p are the normalised router probabilities (softmax, or sigmoid scores divided by their
  sum). It equals 1 under perfectly uniform routing. ``transformers``' ``load_balancing_loss_func``
  returns ``K`` times this value (it divides the counts by T, not T * K).
* router z-loss (ST-MoE): ``z = mean_t logsumexp_e(logits[t])^2``.

Which tokens the statistics cover (``balance_group``, a constructor argument or
``set_balance_group``): by default this rank's tokens. Given a process group, the expert counts
and the token count are summed over that group (one small
all-reduce per layer, on the device) before f_e, P_e and z are formed, while each rank's
differentiable part stays its own tokens' share; summed over the group, the parts give the loss
of all the group's tokens. With the context-parallel group this is the loss of the whole
microbatch, exactly what one process computes (``router_balance_scope: microbatch``); with the
data x context group, Qwen's global-batch balancing (``global_batch``).

The auxiliary-loss-free balancing of DeepSeek-V3 is an option (``expert_bias=True``): a bias per
expert is added to the scores for *selection only* (the weights stay the unbiased scores); the
load seen since the last update is accumulated in forward, and :meth:`Router.update_bias` (call it
after each optimiser step) moves the bias by ``bias_update_rate * sign(mean_load - load_e)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")


@dataclass
class RouterOutput:
    weights: torch.Tensor  # [T, K] fp32, the combine weights of the chosen experts
    expert_ids: torch.Tensor  # [T, K] int64
    logits: torch.Tensor  # [T, E] fp32
    tokens_per_expert: torch.Tensor  # [E] int64, detached
    load_balancing_loss: torch.Tensor  # scalar fp32, differentiable through the probabilities
    z_loss: torch.Tensor  # scalar fp32, differentiable through the logits


def check_router_args(num_experts: int, top_k: int, scoring: str) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k must be in [1, num_experts={num_experts}], got top_k={top_k}: "
            "lower top_k (num_experts_per_tok) or add experts"
        )
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def count_tokens_per_expert(expert_ids: torch.Tensor, num_experts: int,
                            token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[E] int64 histogram of ``expert_ids`` [T, K] (only the tokens of ``token_mask`` [T] if given);
    scatter_add keeps it on device (bincount would sync)."""
    flat = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    ones = torch.ones_like(flat)
    if token_mask is not None:
        ones = ones * token_mask.repeat_interleave(expert_ids.shape[-1]).long()
    return counts.scatter_add_(0, flat, ones)


class Router(nn.Module):
    """Linear gate + top-k selection. ``weight`` is [num_experts, hidden] (the HF ``gate.weight``).

    Args:
        hidden_size, num_experts, top_k: shapes of the routing problem.
        scoring: "softmax" (default, Qwen3-MoE) or "sigmoid" (DeepSeek-V3).
        norm_topk_prob: renormalise the K chosen weights to sum to 1.
        expert_bias: enable auxiliary-loss-free balancing (bias for selection only).
        bias_update_rate: step of :meth:`update_bias`.
        bias: a learned bias on the logits (gpt-oss's ``router.bias``): it enters the scores, the
            selection and the weights alike (unlike ``expert_bias``, which only steers selection).
            gpt-oss takes the softmax over the top-k logits, which is softmax scoring with
            norm_topk_prob (softmax(l)_i / sum_topk softmax(l)_j = exp(l_i) / sum_topk exp(l_j)).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring: str = "softmax",
        norm_topk_prob: bool = True,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        group_score: str = "top2_sum",
        balance_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
        bias: bool = False,
    ):
        super().__init__()
        check_router_args(num_experts, top_k, scoring)
        # Group-limited routing (DeepSeek-V3 / GLM-4.5): the experts form n_group groups, each token
        # picks its topk_group best groups (by the sum of each group's two best scores) and its
        # top_k experts among those. routed_scaling_factor multiplies the final weights.
        # group_score "max": a group ranks by its best score alone (DeepSeek-V2's group_limited_greedy).
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.routed_scaling_factor = routed_scaling_factor
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring = scoring
        # Process group whose tokens the balancing statistics cover (None: this rank's); the
        # expert-parallel plan passes it from model.router_balance_scope (set_balance_group).
        self.balance_group: dist.ProcessGroup | None = balance_group
        self.norm_topk_prob = norm_topk_prob
        self.bias_update_rate = bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, device=device, dtype=dtype)) if bias else None
        if expert_bias:
            # Persistent: the bias is training state and must survive a checkpoint (DeepSeek-V3 name).
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device))
        else:
            self.e_score_correction_bias = None
        # Tokens routed to each expert in training forwards since the last bias update / load report
        # (parallel/step_reductions.step_router_loads: the step's expert_load metric). A buffer counted
        # in place, so torch.compile traces the count as a mutation of a graph input, inside an
        # activation-checkpoint region too (rebinding an attribute there is a side effect dynamo
        # refuses). Not persistent: the count restarts at every step. A model built on the meta
        # device and materialised with to_empty gets it zeroed with every buffer
        # (xorl/models/seeded_init.py; the trainer's load from an HF folder zeroes buffers too).
        # An eager checkpointed block counts its tokens again in the recompute, a compiled one does
        # not (the recompute is part of its graph); both readers are ratios or signs of the counts
        # (expert_load = max / mean, the bias moves by sign(mean - load)), so either count serves.
        self.register_buffer("load_since_update", torch.zeros(num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.init_weights(hidden_size**-0.5)

    def set_balance_group(self, group: dist.ProcessGroup | None) -> None:
        """Compute the balancing statistics over ``group``'s tokens (None: this rank's)."""
        self.balance_group = group

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.bias is not None:
            self.bias.zero_()
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()
        self.load_since_update.zero_()

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None) -> RouterOutput:
        """``token_mask`` [T] bool: tokens that count in the balancing statistics and the load (all
        when None); masked-out tokens (padding) are still routed."""
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states last dim must be hidden_size={self.hidden_size}, got shape {tuple(hidden_states.shape)}"
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        # The matmul runs in the activation dtype (as in transformers); everything after it in fp32.
        logits = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)).float()
        if self.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)

        with torch.no_grad():
            selection = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
            if self.n_group > 1:
                selection = self._limit_to_groups(selection)
            expert_ids = torch.topk(selection, self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor

        if token_mask is None:
            tokens_per_expert = count_tokens_per_expert(expert_ids, self.num_experts)
            num_tokens = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
        else:
            tokens_per_expert = count_tokens_per_expert(expert_ids, self.num_experts, token_mask)
            num_tokens = token_mask.sum().reshape(1).long()
            probs = probs * token_mask.unsqueeze(-1)
        counts = tokens_per_expert
        if self.balance_group is not None and dist.get_world_size(self.balance_group) > 1:
            # Expert counts and token count of every rank of the group, in one all-reduce.
            both = torch.cat([counts, num_tokens])
            dist.all_reduce(both, group=self.balance_group)
            counts, num_tokens = both[:-1], both[-1:]
        # Sums over max(T, 1) rather than means: a rank with no tokens gets 0 losses, not NaN.
        total = num_tokens.clamp(min=1).float()
        fraction_routed = counts.float() / (total * self.top_k)
        mean_probs = probs.sum(dim=0) / total  # this rank's share of the group's mean
        load_balancing_loss = self.num_experts * (fraction_routed * mean_probs).sum()
        z_terms = torch.logsumexp(logits, dim=-1).square()
        if token_mask is not None:  # a multiply, not an index: no device-to-host read for the size
            z_terms = z_terms * token_mask
        z_loss = z_terms.sum() / total[0]

        if self.training:
            self.load_since_update.add_(tokens_per_expert)
        return RouterOutput(weights, expert_ids, logits, tokens_per_expert, load_balancing_loss, z_loss)

    def _limit_to_groups(self, selection: torch.Tensor) -> torch.Tensor:
        """-inf on the experts outside each token's topk_group best groups (transformers' Glm4MoeTopkRouter,
        DeepseekV3TopkRouter; DeepseekV2TopkRouter's group_limited_greedy with group_score "max")."""
        tokens = selection.shape[0]
        grouped = selection.view(tokens, self.n_group, self.num_experts // self.n_group)
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, self.num_experts)

    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Move the selection bias towards balance from the load seen since the last call.

        Pass the data-parallel ``group`` (all ranks that see different tokens for this router) so
        every rank applies the same update. Returns the load that was used (int64 [E]).
        (The trainer updates every router in one all-reduce: parallel/step_reductions.step_router_loads.)
        """
        if self.e_score_correction_bias is None:
            raise RuntimeError("update_bias() needs Router(expert_bias=True)")
        load = self.pending_load()
        if group is not None:
            dist.all_reduce(load, group=group)
        self.apply_load(load)
        return load

    def pending_load(self) -> torch.Tensor:
        """The tokens routed to each expert since the last update (int64 [E], zeros if none)."""
        return self.load_since_update.clone()

    @torch.no_grad()
    def apply_load(self, load: torch.Tensor) -> None:
        """With an expert bias: bias += rate * sign(mean(load) - load), from an already summed load.
        Resets the count either way."""
        if self.e_score_correction_bias is not None:
            error = load.float().mean() - load.float()
            self.e_score_correction_bias += self.bias_update_rate * torch.sign(error)
        self.load_since_update.zero_()

    def extra_repr(self) -> str:
        bias = ", expert_bias=True" if self.e_score_correction_bias is not None else ""
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"scoring={self.scoring}, norm_topk_prob={self.norm_topk_prob}{bias}"
        )
