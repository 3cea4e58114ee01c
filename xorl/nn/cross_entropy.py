"""Summed token cross-entropy of whole or vocabulary-sharded logits (loss parallel).

``cross_entropy_sum(logits, labels)``: the sum of per-token cross-entropies over label tokens
(``labels != -100``), in fp32. ``logits`` is either a plain tensor ``[..., vocab]`` or a DTensor
sharded on its last dim over a 1-D tensor-parallel mesh (what a vocabulary-parallel lm_head returns,
``Shard(-1)``): then each rank holds ``vocab / P`` columns and the loss is computed without ever
gathering them (Megatron's vocab-parallel cross-entropy). Per token: the max over the vocabulary
(all-reduce MAX), then the sum of exponentials and the target's logit together (one all-reduce SUM
of a [2, tokens] buffer); every TP rank ends with the same loss. Backward needs no communication:
each rank's logit gradient is softmax minus the one-hot target on its own columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies over label tokens, fp32; see the module docstring."""
    if not isinstance(logits, DTensor):
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
    mesh, placements = logits.device_mesh, logits.placements
    if mesh.ndim != 1 or not placements[0].is_shard(logits.ndim - 1):
        raise ValueError(
            f"vocabulary-parallel logits must be sharded on their last dim over a 1-D mesh, got {placements} "
            f"on a {mesh.ndim}-D mesh"
        )
    local = logits.to_local()
    vocab_start = mesh.get_local_rank() * local.shape[-1]
    return _VocabParallelCrossEntropySum.apply(
        local.reshape(-1, local.shape[-1]), labels.reshape(-1), vocab_start, mesh.get_group()
    )


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group):
        logits = logits.float()
        width = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_index = labels - vocab_start
        mine = (local_index >= 0) & (local_index < width)  # the target column lives on this rank
        safe = local_index.clamp(0, width - 1).unsqueeze(-1)
        target = shifted.gather(-1, safe).squeeze(-1) * mine
        sums = torch.stack([exp.sum(dim=-1), target])
        dist.all_reduce(sums, group=group)
        valid = labels != IGNORE_INDEX
        per_token = (sums[0].log() - sums[1]) * valid
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, safe, mine & valid, valid)
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad_out):
        softmax, safe, target_here, valid = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)
        grad.scatter_add_(-1, safe, -target_here.to(grad.dtype).unsqueeze(-1))
        return grad * grad_out, None, None, None
