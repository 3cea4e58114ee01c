"""``xorl.nn.MoE``: a drop-in mixture-of-experts block (router + dispatch + grouped experts + combine).

State-dict names follow the HF Qwen3-MoE block (transformers 5's fused experts, in the grouped
GEMM's [groups, in, out] layout); ``load_state_dict`` also takes the split ``experts.gate_proj`` /
``experts.up_proj`` [E, hidden, moe_intermediate] of the reference block (tests/moe_reference.py):

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

Under EP the losses use this rank's tokens only (the "micro-batch local" variant).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xorl._torch_compat import all_to_all_single_autograd, resolve_process_group
from xorl.nn.moe_experts import GroupedExperts
from xorl.nn.router import Router, check_router_args
from xorl.nn.tp_comm import TPGroup
from xorl.nn.tp_regions import gather_from_shards, split_to_shard
from xorl_kernels.activation.op import swiglu
from xorl_kernels.checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens


# ----------------------------------------------------------------------------------------------
# Expert-parallel token dispatch and combine over an EP process group
#
# Each of the ``ep`` ranks of the group owns ``num_experts / ep`` consecutive experts (rank r owns
# experts ``[r * E_local, (r + 1) * E_local)``). A token routed to several experts of one rank is
# sent there once (DeepEP's deduplication): the hidden rows that travel are the (token, destination
# rank) pairs, on average fewer than K per token (Qwen3-30B, top-8 of 128 at EP 4: ~3.6 instead of
# 8). One MoE forward on rank r:
#
# 1. the T*K routing slots sorted by (destination rank, token, k); the first slot of each (rank,
#    token) opens a pair. Counts of pairs and slots per destination: one even ``all_to_all_single``
#    of ``ep x 2`` counts, then the split sizes are read on the host. This sync is unavoidable:
#    NCCL's uneven all_to_all takes its split sizes as host integers.
# 2. dispatch: the pairs' hidden rows (``all_to_all_single``, uneven splits), and beside them each
#    slot's metadata (router weight, local expert, pair index: 3 numbers, 24 bytes a slot).
# 3. on arrival each pair is expanded to its slots, which run through the local experts grouped by
#    expert (``permute_tokens``, grouped GEMMs, ``unpermute_tokens``), and each pair's slots are
#    summed with their weights into one row (fp32 ``index_add``: exact order on CPU; on CUDA the
#    order of a pair's <= K additions may vary run to run at fp32 rounding).
# 4. combine: the reverse all_to_all of one row per pair, and each token sums its pairs (fp32). The
#    rows travel back in the activations' dtype (a pair's partial sum is rounded once there, as in
#    DeepEP's combine).
#
# The collectives are torch.library custom ops (the group travels by name), except the dispatch of
# the hidden rows: torch's functional all_to_all (also traceable), which returns before the rows
# arrive, so the shared expert (``overlap``) is computed meanwhile. Each row all_to_all's backward is
# the reverse all_to_all, so gradients reach the tokens' home ranks and
# every expert's gradient accumulates on its owner. An expert (or a whole rank) that receives no
# rows joins every collective with empty buffers, and its weight gradients are exact zeros
# (grouped_gemm of an empty group). Under torch.compile the split sizes read in step 1 become
# unbacked symbolic ints (xorl/parallelize.py turns on torch._dynamo's capture_scalar_outputs for
# that), so the block stays one graph, with the one host read still in it.
# ----------------------------------------------------------------------------------------------
def _group(group_name: str):
    return resolve_process_group(group_name)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::ep_all_to_all")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::ep_all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=_group(group_name))
    return out


@_all_to_all_op.register_fake
def _(x, output_splits, input_splits, group_name):
    return x.new_empty((sum(output_splits), *x.shape[1:]))


def _all_to_all_setup(ctx, inputs, output):
    _, ctx.output_splits, ctx.input_splits, ctx.group_name = inputs


def _all_to_all_backward(ctx, grad_out):
    grad_in = torch.ops.xorl.ep_all_to_all(grad_out.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group_name)
    return grad_in, None, None, None


_all_to_all_op.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all_to_all over dim 0: send ``input_splits[r]`` rows to rank r."""
    return torch.ops.xorl.ep_all_to_all(x, output_splits, input_splits, group.group_name)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::ep_exchange_counts")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::ep_exchange_counts", mutates_args=())
def _exchange_counts_op(send_counts: torch.Tensor, group_name: str) -> torch.Tensor:
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=_group(group_name))
    return recv_counts


@_exchange_counts_op.register_fake
def _(send_counts, group_name):
    return torch.empty_like(send_counts)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """send_counts [ep, E_local] (rows this rank sends to rank r for its expert e) -> the counts
    every rank sends to this one, same shape, on the same device (no host sync here)."""
    return torch.ops.xorl.ep_exchange_counts(send_counts, group.group_name)


def expert_parallel_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    experts,
    num_experts: int,
    group,
    overlap=None,
) -> torch.Tensor:
    """Route ``x`` [T, H] to the experts given by ``expert_ids`` [T, K] (global ids), run them
    where they live, and combine with ``weights`` [T, K]. ``experts(x_sorted, tokens_per_expert)``
    computes this rank's ``num_experts / ep`` experts. ``group=None`` or a 1-rank group runs
    everything locally. ``overlap``: a function of nothing returning [T, H] to add to the output
    (the shared expert), run while the dispatch all_to_all is in flight."""
    ep_size = 1 if group is None else dist.get_world_size(group)
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}; "
            "choose expert_parallel_size dividing num_experts"
        )
    if ep_size == 1:
        x_sorted, row_map, tokens_per_expert = permute_tokens(x, expert_ids, num_experts)
        out = unpermute_tokens(experts(x_sorted, tokens_per_expert), row_map, weights)
        return out if overlap is None else out + overlap()
    return _deduplicated_dispatch(x, expert_ids, weights, experts, num_experts // ep_size, ep_size, group, overlap)


def _deduplicated_dispatch(x, expert_ids, weights, experts, num_local: int, ep_size: int, group,
                           overlap) -> torch.Tensor:
    """Steps 1-4 of the module docstring: one row per (token, destination rank) each way."""
    device, (num_tokens, top_k) = x.device, expert_ids.shape
    # Slots, the T*K (token, k) routing choices, in travel order: by destination rank, then token, then k.
    dest = expert_ids.long() // num_local
    slot_key = dest * (num_tokens * top_k) + torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)
    order = torch.argsort(slot_key.reshape(-1))
    slot_dest, slot_token = dest.reshape(-1)[order], order // top_k
    # A slot opens a pair when it is the first of its (destination, token): the rows that travel.
    opens = torch.ones_like(slot_dest, dtype=torch.bool)
    opens[1:] = (slot_dest[1:] != slot_dest[:-1]) | (slot_token[1:] != slot_token[:-1])
    pair_of_slot = torch.cumsum(opens, 0) - 1
    # Counts by index_add, not bincount or a boolean mask: no device-to-host read before the one below.
    ones = torch.ones_like(slot_dest)
    send = torch.zeros(ep_size, 2, dtype=torch.long, device=device)
    send[:, 0].index_add_(0, slot_dest, opens.long())
    send[:, 1].index_add_(0, slot_dest, ones)
    recv = exchange_counts(send, group)  # [ep, 2]: pairs and slots from each rank
    # Host sync (see module docstring): the split sizes of the uneven all_to_alls, in one read.
    send_pairs, send_slots, recv_pairs, recv_slots = torch.cat([send.t(), recv.t()]).tolist()
    for n in (*send_pairs, *recv_pairs, *send_slots, *recv_slots):
        torch._check(n >= 0)
    torch._check(sum(send_slots) == num_tokens * top_k)
    opening = torch.nonzero_static(opens, size=sum(send_pairs)).squeeze(1)  # the size is known: no sync
    pair_token = slot_token[opening]

    # Each slot's metadata, sent beside its pair: the router weight (differentiable through the
    # all_to_all), the local expert and the pair's index within the block sent to that rank.
    pair_start = torch.cumsum(send[:, 0], 0) - send[:, 0]
    slot_info = torch.stack([weights.reshape(-1)[order].double(), (expert_ids.reshape(-1)[order] % num_local).double(),
                        (pair_of_slot - pair_start[slot_dest]).double()], dim=1)
    slot_info_recv = all_to_all_rows(slot_info, recv_slots, send_slots, group)
    # The hidden rows go last and are waited for at their first use: torch's functional all_to_all
    # (differentiable) returns at once, so the ``overlap`` work (the shared expert) is queued on the
    # compute stream while NCCL moves the rows (on CPU / gloo it simply runs in order).
    x_recv = all_to_all_single_autograd(x.index_select(0, pair_token), recv_pairs, send_pairs, group)
    extra = overlap() if overlap is not None else None

    # On arrival: expand each pair to its slots, run the local experts grouped, and sum each pair's
    # slots with their weights.
    src_of_slot = torch.repeat_interleave(torch.arange(ep_size, device=device), recv[:, 1],
                                          output_size=slot_info_recv.shape[0])
    recv_pair_start = torch.cumsum(recv[:, 0], 0) - recv[:, 0]
    pair_idx = slot_info_recv[:, 2].long() + recv_pair_start[src_of_slot]
    x_slots = x_recv.index_select(0, pair_idx)
    x_local, local_row_map, tokens_per_local = permute_tokens(x_slots, slot_info_recv[:, 1].long()[:, None], num_local)
    y_slots = unpermute_tokens(experts(x_local, tokens_per_local), local_row_map)
    # fp32 sums by index_add (no host read; on CUDA the order of a pair's <= K additions may vary
    # run to run at fp32 rounding, before the cast).
    weighted = y_slots.float() * slot_info_recv[:, :1].float()
    y_pairs = weighted.new_zeros(x_recv.shape[0], weighted.shape[1]).index_add(0, pair_idx, weighted).to(x.dtype)

    # Combine: the reverse all_to_all, then each token sums its pairs (at most min(K, ep)).
    y_back = all_to_all_rows(y_pairs, send_pairs, recv_pairs, group)
    out = y_back.new_zeros(num_tokens, y_back.shape[1], dtype=torch.float32)
    out = out.index_add(0, pair_token, y_back.float()).to(x.dtype)
    return out if extra is None else out + extra


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
        returns_aux: False for a drop-in replacement of a ``transformers`` block, whose caller
            expects the output alone (``from_block``); the auxiliary losses are then not returned.
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
        returns_aux: bool = True,
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
        self.returns_aux = returns_aux
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
        return (out, aux) if self.returns_aux else out

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

    @classmethod
    def from_block(cls, block: nn.Module, *, ep_group=None, **overrides) -> MoE:
        """Build an MoE from an xorl or ``transformers`` Qwen3-MoE / Qwen2-MoE sparse block, copying
        its weights (only this rank's experts under EP). Router settings (top_k, norm_topk_prob)
        are read from the block; pass them as keyword overrides if the block does not carry them."""
        from xorl.nn.moe_convert import describe_block

        spec = describe_block(block)
        spec.update(overrides)
        weights = spec.pop("_weights")
        ref = weights["gate_proj"]
        spec.setdefault("returns_aux", False)  # the block's callers expect its output alone
        moe = cls(ep_group=ep_group, device=ref.device, dtype=ref.dtype, **spec)
        with torch.no_grad():
            moe.gate.weight.copy_(weights["gate"])
            moe.load_experts(weights["gate_proj"], weights["up_proj"], weights["down_proj"])
            if moe.shared_expert is not None:
                moe.shared_expert.load_state_dict(weights["shared_expert"])
                moe.shared_expert_gate.weight.copy_(weights["shared_expert_gate"])
            if moe.gate.e_score_correction_bias is not None and "e_score_correction_bias" in weights:
                moe.gate.e_score_correction_bias.copy_(weights["e_score_correction_bias"])
        return moe

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.local_expert_range}, top_k={self.top_k}, "
            f"ep_size={self.ep_size}, aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}"
        )

