"""``xorl.nn.MoE``: a mixture-of-experts block (router + dispatch + grouped experts + combine).

State-dict names follow the HF Qwen3-MoE block (transformers 5's fused experts, in the grouped
GEMM's [groups, in, out] layout); ``load_state_dict`` also takes the split ``experts.gate_proj`` /
``experts.up_proj`` [E, hidden, moe_intermediate] of the reference block (tests/support/moe_reference.py):

    gate.weight              [E, hidden]                    (router)
    experts.gate_up_proj     [E, hidden, 2*moe_intermediate]  ([groups, in, out]; gate columns, then up)
    experts.down_proj        [E, moe_intermediate, hidden]
    shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight   (optional, Qwen2-MoE)
    gate.e_score_correction_bias                            (only with expert_bias=True)

With an EP group of size ep the module holds only this rank's E/ep experts; loading a state dict
with the full [E, ...] expert tensors slices out the local experts automatically. After
``moe.experts.distribute_over(ep_mesh["ep"])`` (what ``apply_expert_parallel`` does when given the
EP DeviceMesh) the expert weights are DTensors of global shape [E, ...] sharded on dim 0, so
``state_dict()`` / DCP checkpoints see every expert once, under one name, and ``full_tensor()``
of a gradient is the full [E, ...] gradient.

``forward(hidden_states [..., hidden]) -> (out [..., hidden], aux: MoEAux)``: the output has the
input's shape (like ``transformers``' ``Qwen3MoeSparseMoeBlock``'s first output), and ``aux`` carries
the block's auxiliary losses of this forward (returned, never kept on the module):

* ``aux.loss``: ``aux_loss_coef * load_balancing + z_loss_coef * z_loss``, a differentiable scalar
  to add to the training loss (the decoder sums it over its MoE blocks);
* ``aux.load_balancing_loss``, ``aux.z_loss``, ``aux.tokens_per_expert``: detached statistics
  (tokens_per_expert is the [E] load of this rank's tokens). Nothing here syncs with the host.

Under EP the losses use this rank's tokens only (the "micro-batch local" variant). The tokens reach
their experts and come back through ``expert_parallel_moe`` (xorl/nn/ep_dispatch.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xorl.nn.ep_dispatch import expert_parallel_moe
from xorl.nn.moe_experts import GroupedExperts
from xorl.nn.router import Router, check_router_args
from xorl.nn.tp_comm import TPGroup
from xorl.nn.tp_regions import gather_from_shards, split_to_shard
from xorl_kernels.activation.op import swiglu

_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_SEQ_DIM = -2


class MoEAux(NamedTuple):
    """What one MoE forward returns beside its output (a NamedTuple: it passes through
    torch.compile, activation checkpointing and FSDP's output hooks as a plain pytree)."""

    loss: torch.Tensor  # aux_loss_coef * load_balancing + z_loss_coef * z_loss (differentiable)
    load_balancing_loss: torch.Tensor  # detached
    z_loss: torch.Tensor  # detached
    tokens_per_expert: torch.Tensor  # [E] int64, this rank's tokens


class SharedExpertMLP(nn.Module):
    """Dense SwiGLU MLP with the HF names (gate_proj / up_proj / down_proj Linear layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, optionally expert-parallel over ``ep_group``.

    Args:
        hidden_size, num_experts, top_k, moe_intermediate_size: the layer's shapes.
        norm_topk_prob: renormalise the top-k weights (Qwen3-MoE: true).
        scoring: "softmax" or "sigmoid" router scores (fp32) (the config's ``router_scoring``).
        expert_bias, bias_update_rate: auxiliary-loss-free balancing (see ``Router.update_bias``).
        shared_expert_intermediate_size: > 0 adds a Qwen2-MoE shared expert with a sigmoid gate.
        aux_loss_coef, z_loss_coef: weights of the two losses in ``MoEAux.loss``.
        ep_group: expert-parallel process group (None: all experts local).
        balance_group: the group whose tokens the load-balancing statistics cover (``Router``).
        router_bias: a learned bias on the router logits (gpt-oss).
        expert_biases, swiglu_alpha, swiglu_limit: gpt-oss experts (per-expert biases, clamped
            SwiGLU when swiglu_limit is set; ``GroupedExperts``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        *,
        norm_topk_prob: bool = True,
        scoring: str = "softmax",
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        group_score: str = "top2_sum",
        shared_expert_intermediate_size: int = 0,
        shared_expert_gate: bool = True,
        aux_loss_coef: float = 1e-3,
        z_loss_coef: float = 0.0,
        ep_group: dist.ProcessGroup | None = None,
        balance_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
        fp8: str = "none",
        lora=None,
        router_bias: bool = False,
        expert_biases: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        check_router_args(num_experts, top_k, scoring)
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}: "
                "set expert_parallel_size to a divisor of num_experts"
            )
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.top_k = top_k
        self.moe_intermediate_size = moe_intermediate_size
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.gate = Router(
            hidden_size,
            num_experts,
            top_k,
            scoring=scoring,
            norm_topk_prob=norm_topk_prob,
            expert_bias=expert_bias,
            bias_update_rate=bias_update_rate,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            group_score=group_score,
            balance_group=balance_group,
            device=device,
            dtype=dtype,
            bias=router_bias,
        )
        self.experts = GroupedExperts(
            self.num_local_experts, hidden_size, moe_intermediate_size, device=device, dtype=dtype, fp8=fp8,
            lora=lora,
            bias=expert_biases, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        )
        if shared_expert_intermediate_size > 0:
            self.shared_expert = SharedExpertMLP(hidden_size, shared_expert_intermediate_size, device, dtype)
            # Qwen2-MoE gates the shared expert with sigmoid(shared_expert_gate(x)); GLM-4.5 does not.
            self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False, device=device, dtype=dtype)
                                       if shared_expert_gate else None)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        # Tensor parallelism (``run_on_token_shards``): this block then runs on this TP rank's tokens.
        self.token_shards: TPGroup | None = None
        self.tokens_arrive_sharded = False
        self._register_load_state_dict_pre_hook(self._slice_full_experts)

    def distribute_experts(self, ep_mesh) -> None:
        """Expert parallelism over the 1-D ``ep_mesh``: keep this rank's ``E / ep`` experts as
        DTensors of global shape [E, ...] (so checkpoints and norms see each expert once) and
        dispatch tokens over its group. Called once, on a block holding all E experts."""
        if self.ep_size != 1:
            raise RuntimeError("distribute_experts: this MoE is already expert-parallel")
        size = ep_mesh.size()
        if self.num_experts % size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size {size}: "
                "set expert_parallel_size to a divisor of num_experts"
            )
        self.experts.distribute_over(ep_mesh)
        self.ep_group = ep_mesh.get_group()
        self.ep_size, self.ep_rank = size, ep_mesh.get_local_rank()
        self.num_local_experts = self.num_experts // size

    def set_balance_group(self, group: dist.ProcessGroup | None) -> None:
        """The tokens the router's load-balancing statistics cover (see ``Router``)."""
        self.gate.set_balance_group(group)

    def run_on_token_shards(self, tp: TPGroup, sequence_parallel: bool) -> None:
        """Under tensor parallelism: route and compute only this TP rank's share of the tokens.

        Why: attention is TP-sharded by heads, but an MoE block's experts are split by expert
        parallelism, so no TP rank need compute another's tokens. Under sequence parallel the input
        already is this rank's sequence shard; without it the block keeps its chunk of the
        replicated sequence and gathers the outputs again. A ``token_mask`` covers the whole
        (context-parallel local) sequence and is chunked the same way.
        """
        self.token_shards = tp
        self.tokens_arrive_sharded = bool(sequence_parallel)

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """[first, last) global ids of the experts this rank holds."""
        first = self.ep_rank * self.num_local_experts
        return first, first + self.num_local_experts

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MoEAux]:
        """``token_mask`` (bool, the shape of ``hidden_states`` without its last dim): tokens to leave
        out of the routing statistics (padding); they are still routed and computed."""
        tp = self.token_shards
        if tp is not None and tp.size > 1:
            if token_mask is not None:
                token_mask = token_mask.chunk(tp.size, dim=-1)[tp.rank]
            if not self.tokens_arrive_sharded:
                hidden_states = split_to_shard(hidden_states, tp, _SEQ_DIM)
        out, aux = self._routed_forward(hidden_states, token_mask)
        if tp is not None and tp.size > 1 and not self.tokens_arrive_sharded:
            out = gather_from_shards(out, tp, _SEQ_DIM)
        return out, aux

    def _routed_forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None):
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states last dim must be {self.hidden_size}, got {tuple(hidden_states.shape)}")
        x = hidden_states.reshape(-1, self.hidden_size)
        routed = self.gate(x, None if token_mask is None else token_mask.reshape(-1))
        shared = None
        if self.shared_expert is not None:  # computed while the dispatch all_to_all is in flight

            def shared():
                if self.shared_expert_gate is None:
                    return self.shared_expert(x)
                return self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))

        out = expert_parallel_moe(
            x,
            routed.expert_ids,
            routed.weights,
            self.experts,
            self.num_experts,
            self.ep_group if self.ep_size > 1 else None,
            overlap=shared,
        )
        aux = MoEAux(
            loss=self.aux_loss_coef * routed.load_balancing_loss + self.z_loss_coef * routed.z_loss,
            load_balancing_loss=routed.load_balancing_loss.detach(),
            z_loss=routed.z_loss.detach(),
            tokens_per_expert=routed.tokens_per_expert,
        )
        return out.view(hidden_states.shape), aux

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """normal(0, std) for the router, the experts and the shared expert (the xorl model calls this)."""
        self.gate.init_weights(std)
        self.experts.init_weights(std)
        if self.shared_expert is not None:
            for linear in (*self.shared_expert.children(), self.shared_expert_gate):
                if linear is not None:
                    nn.init.normal_(linear.weight, std=std)

    # -- loading --------------------------------------------------------------------------------
    def _slice_full_experts(self, state_dict, prefix, *args, **kwargs):
        """Accept full [E, ...] expert tensors under EP by keeping this rank's slice, and split gate /
        up weights (joined into gate_up_proj)."""
        first, last = self.local_expert_range
        gate, up = state_dict.get(f"{prefix}experts.gate_proj"), state_dict.get(f"{prefix}experts.up_proj")
        if gate is not None and up is not None and f"{prefix}experts.gate_up_proj" not in state_dict:
            state_dict[f"{prefix}experts.gate_up_proj"] = torch.cat([state_dict.pop(f"{prefix}experts.gate_proj"),
                                                                   state_dict.pop(f"{prefix}experts.up_proj")], dim=2)
        for name in self.experts.param_names:
            key = f"{prefix}experts.{name}"
            value = state_dict.get(key)
            if value is None or isinstance(value, DTensor) or value.shape[0] != self.num_experts:
                continue
            param = getattr(self.experts, name)
            if isinstance(param, DTensor):
                if param.device_mesh.ndim == 1:  # experts distributed over the EP mesh only
                    state_dict[key] = DTensor.from_local(value[first:last], param.device_mesh, param.placements)
                # Further sharded (FSDP): load with torch.distributed.checkpoint's set_model_state_dict.
            elif self.num_experts != self.num_local_experts:
                state_dict[key] = value[first:last]

    @torch.no_grad()
    def load_experts(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        """Copy full ([E, in, out]) or local ([E/ep, in, out]) expert weights; gate and up are
        joined into ``experts.gate_up_proj``."""
        first, last = self.local_expert_range
        if gate_proj.shape != up_proj.shape:
            raise ValueError(f"expected gate_proj and up_proj of one shape, got {tuple(gate_proj.shape)} and "
                             f"{tuple(up_proj.shape)}")
        for name, full in zip(_EXPERT_PARAMS, (torch.cat([gate_proj, up_proj], dim=2), down_proj)):
            param = getattr(self.experts, name)
            src = full[first:last] if full.shape[0] == self.num_experts else full
            if src.shape != param.shape:
                raise ValueError(
                    f"experts.{name}: expected {tuple(param.shape)} (or the full "
                    f"[{self.num_experts}, ...] tensor), got {tuple(full.shape)}"
                )
            param.copy_(src)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.local_expert_range}, top_k={self.top_k}, "
            f"ep_size={self.ep_size}, aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}"
        )

