"""Expert-parallel token dispatch and combine over an EP process group, for ``xorl.nn.MoE``
(xorl/nn/moe.py): ``expert_parallel_moe``.

Each of the ``ep`` ranks of the group owns ``num_experts / ep`` consecutive experts (rank r owns
experts ``[r * E_local, (r + 1) * E_local)``). A token routed to several experts of one rank is
sent there once (DeepEP's deduplication): the hidden rows that travel are the (token, destination
rank) pairs, on average fewer than K per token (Qwen3-30B, top-8 of 128 at EP 4: ~3.6 instead of
8). One MoE forward on rank r:

1. the T*K routing slots sorted by (destination rank, token, k); the first slot of each (rank,
   token) opens a pair. Counts of pairs and slots per destination: one even ``all_to_all_single``
   of ``ep x 2`` counts, then the split sizes are read on the host. This sync is unavoidable:
   NCCL's uneven all_to_all takes its split sizes as host integers.
2. dispatch: the pairs' hidden rows (``all_to_all_single``, uneven splits), and beside them each
   slot's metadata (router weight, local expert, pair index: 3 numbers, 24 bytes a slot).
3. on arrival each pair is expanded to its slots, which run through the local experts grouped by
   expert (``permute_tokens``, grouped GEMMs, ``unpermute_tokens``), and each pair's slots are
   summed with their weights into one row (fp32 ``index_add``: exact order on CPU; on CUDA the
   order of a pair's <= K additions may vary run to run at fp32 rounding).
4. combine: the reverse all_to_all of one row per pair, and each token sums its pairs (fp32). The
   rows travel back in the activations' dtype (a pair's partial sum is rounded once there, as in
   DeepEP's combine).

The collectives are torch.library custom ops (the group travels by name), except the dispatch of
the hidden rows: torch's functional all_to_all (also traceable), which returns before the rows
arrive, so the shared expert (``overlap``) is computed meanwhile. Each row all_to_all's backward is
the reverse all_to_all, so gradients reach the tokens' home ranks and
every expert's gradient accumulates on its owner. An expert (or a whole rank) that receives no
rows joins every collective with empty buffers, and its weight gradients are exact zeros
(grouped_gemm of an empty group). Under torch.compile the split sizes read in step 1 become
unbacked symbolic ints (xorl/parallel/compile.py turns on torch._dynamo's capture_scalar_outputs for
that), so the block stays one graph, with the one host read still in it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xorl._torch_compat import all_to_all_single_autograd, resolve_process_group
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES


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
