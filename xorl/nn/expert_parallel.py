"""Expert-parallel token dispatch and combine over an EP process group.

Each of the ``ep`` ranks of the group owns ``num_experts / ep`` consecutive experts (rank r owns
experts ``[r * E_local, (r + 1) * E_local)``). One MoE forward on rank r:

1. ``permute_tokens``: the T*K (token, k) rows sorted by global expert, hence grouped by the rank
   that owns the expert (tokens_per_expert.view(ep, E_local) = rows per destination and expert).
2. counts exchange: one even ``all_to_all_single`` of those ``ep * E_local`` counts, then the split
   sizes are read on the host. This sync is unavoidable: NCCL's uneven all_to_all takes its split
   sizes as host integers (the payload size must be known before the buffers are allocated).
3. dispatch: ``all_to_all_single`` of the rows with uneven splits. Received rows arrive ordered
   [source rank][local expert][token]; they are re-sorted by local expert (a second permute)
   so the experts see contiguous groups.
4. the local experts (grouped GEMMs), then the inverse re-sort, the reverse all_to_all (combine)
   and ``unpermute_tokens`` with the router weights (fp32, deterministic).

Both collectives are torch.library custom ops (the group travels by name), and the row
all_to_all's backward is the reverse all_to_all, so gradients reach the tokens' home ranks and
every expert's gradient accumulates on its owner. An expert (or a whole rank) that receives no
rows joins every collective with empty buffers, and its weight gradients are exact zeros
(grouped_gemm of an empty group). Under torch.compile the split sizes read in step 2 become
unbacked symbolic ints (xorl/parallelize.py turns on torch._dynamo's capture_scalar_outputs for
that), so the block stays one graph, with the one host read still in it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


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
) -> torch.Tensor:
    """Route ``x`` [T, H] to the experts given by ``expert_ids`` [T, K] (global ids), run them
    where they live, and combine with ``weights`` [T, K]. ``experts(x_sorted, tokens_per_expert)``
    computes this rank's ``num_experts / ep`` experts. ``group=None`` or a 1-rank group runs
    everything locally."""
    ep_size = 1 if group is None else dist.get_world_size(group)
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}; "
            "choose expert_parallel_size dividing num_experts"
        )
    x_sorted, row_map, tokens_per_expert = permute_tokens(x, expert_ids, num_experts)
    if ep_size == 1:
        return unpermute_tokens(experts(x_sorted, tokens_per_expert), row_map, weights)

    num_local = num_experts // ep_size
    send_counts = tokens_per_expert.view(ep_size, num_local)
    recv_counts = exchange_counts(send_counts, group)
    # Host sync (see module docstring): the split sizes of the uneven all_to_all.
    both = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    input_splits, output_splits = both[0], both[1]
    # What the counts guarantee, told to torch.compile (no-ops in eager): no negative split, and
    # the rows sent are the rows permute_tokens produced (so the combine returns T*K rows).
    for n in (*input_splits, *output_splits):
        torch._check(n >= 0)
    torch._check(sum(input_splits) == x_sorted.shape[0])
    x_recv = all_to_all_rows(x_sorted, output_splits, input_splits, group)

    # Rows arrive as [source rank][local expert]; regroup them by local expert.
    if num_local > 1:
        local_ids = torch.arange(num_local, device=x.device).repeat(ep_size)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=x_recv.shape[0])
        x_local, local_row_map, tokens_per_local = permute_tokens(x_recv, local_ids[:, None], num_local)
        y_local = unpermute_tokens(experts(x_local, tokens_per_local), local_row_map)
    else:
        y_local = experts(x_recv, recv_counts.sum(0))

    y_sorted = all_to_all_rows(y_local, input_splits, output_splits, group)
    return unpermute_tokens(y_sorted, row_map, weights)
