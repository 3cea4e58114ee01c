"""Summed token cross-entropy of whole or vocabulary-sharded logits (loss parallel).

``cross_entropy_sum(logits, labels)``: the sum of per-token cross-entropies over label tokens
(``labels != -100``), in fp32. ``logits`` is either a plain tensor ``[..., vocab]`` or a DTensor
sharded on its last dim over a 1-D tensor-parallel mesh (what a vocabulary-parallel lm_head returns,
``Shard(-1)``): then each rank holds ``vocab / P`` columns and the loss is computed without ever
gathering them (Megatron's vocab-parallel cross-entropy). Per token: the max over the vocabulary
(all-reduce MAX), then the sum of exponentials and the target's logit together (one all-reduce SUM
of a [2, tokens] buffer); every TP rank ends with the same loss. Backward needs no communication:
each rank's logit gradient is softmax minus the one-hot target on its own columns.

``z_loss``: adds ``z_loss * lse**2`` per label token (PaLM's z-loss; 0, the default, is the plain loss).

``linear_cross_entropy_sum(hidden, lm_head, labels)``: the same sum straight from the last hidden
states and the lm_head module, through the fused chunked kernel
(``xorl_kernels.fused_linear_cross_entropy``): no ``[tokens, vocab]`` logits are ever held. A
``VocabParallelLMHead`` runs it on its vocabulary shard with the same two all-reduces per chunk of
tokens (on [chunk] buffers); its input is gathered along the sequence under sequence parallel (and
the partial input gradients reduce-scattered back), else the input gradient is all-reduced, as the
column layer does. Any other head (a replicated-over-TP one, one with a bias) takes the unfused path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from xorl.nn.tp_comm import all_gather_sequence, reduce_scatter_sequence
from xorl_kernels.fused_linear_ce.op import fused_linear_cross_entropy

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Sum of cross-entropies (+ z-loss) over label tokens, fp32; see the module docstring."""
    if not isinstance(logits, DTensor):
        flat, flat_labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
        loss = F.cross_entropy(flat, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        if z_loss:
            lse = flat.logsumexp(-1)
            loss = loss + z_loss * (lse * lse * (flat_labels != IGNORE_INDEX)).sum()
        return loss
    mesh, placements = logits.device_mesh, logits.placements
    if mesh.ndim != 1 or not placements[0].is_shard(logits.ndim - 1):
        raise ValueError(
            f"vocabulary-parallel logits must be sharded on their last dim over a 1-D mesh, got {placements} "
            f"on a {mesh.ndim}-D mesh"
        )
    local = logits.to_local()
    vocab_start = mesh.get_local_rank() * local.shape[-1]
    return _VocabParallelCrossEntropySum.apply(
        local.reshape(-1, local.shape[-1]), labels.reshape(-1), vocab_start, mesh.get_group(), float(z_loss)
    )


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group, z_loss: float):
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
        lse_shifted = sums[0].log()
        lse = lse_shifted + row_max
        per_token = (lse_shifted - sums[1] + z_loss * lse * lse) * valid
        softmax = exp.div_(sums[0].unsqueeze(-1))
        if z_loss:  # d(z lse^2)/d logit = 2 z lse softmax
            softmax.mul_((1.0 + 2.0 * z_loss * lse).unsqueeze(-1))
        ctx.save_for_backward(softmax, safe, mine & valid, valid)
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad_out):
        softmax, safe, target_here, valid = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)
        grad.scatter_add_(-1, safe, -target_here.to(grad.dtype).unsqueeze(-1))
        return grad * grad_out, None, None, None, None


class _GroupReduce:
    """The in-place all-reduces the fused kernel asks for, over one process group."""

    def __init__(self, group):
        self.group = group

    def max_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def sum_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)


class _EnterVocabParallel(torch.autograd.Function):
    """The lm_head's input entering the vocabulary-parallel region, as a column layer takes it:
    under sequence parallel the shards are gathered along the sequence (backward reduce-scatters
    the partial gradients), else the replicated input passes (backward all-reduces them)."""

    @staticmethod
    def forward(ctx, x, tp, stats, sequence_parallel: bool):
        ctx.tp, ctx.stats, ctx.sequence_parallel = tp, stats, sequence_parallel
        return all_gather_sequence(x, tp, stats) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.sequence_parallel:
            return reduce_scatter_sequence(grad, ctx.tp, ctx.stats), None, None, None
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor,
                             z_loss: float = 0.0) -> torch.Tensor:
    """Sum of cross-entropies (+ z-loss) of ``lm_head(hidden)`` over label tokens, fp32, fused where
    the head allows (see the module docstring). ``hidden`` [..., seq(/TP under SP), H], ``labels`` [..., seq]."""
    from xorl.nn.tp_vocab import VocabParallelLMHead

    if isinstance(lm_head, VocabParallelLMHead) and lm_head.bias is None:
        tp = lm_head.tp
        if tp.size > 1:
            hidden = _EnterVocabParallel.apply(hidden, tp, lm_head.config.stats, lm_head.sequence_parallel)
        weight = lm_head.weight.to_local()
        vocab_start, reduce = tp.rank * weight.shape[0], (_GroupReduce(tp.group) if tp.size > 1 else None)
    elif type(lm_head) is nn.Linear and lm_head.bias is None and not isinstance(lm_head.weight, DTensor):
        weight, vocab_start, reduce = lm_head.weight, 0, None
    else:  # replicated-over-TP or biased heads: the unfused path
        return cross_entropy_sum(lm_head(hidden), labels, z_loss)
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal [batch, seq]={tuple(hidden.shape[:-1])}")
    if torch.is_autocast_enabled(hidden.device.type):  # as F.linear would run under autocast
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), ignore_index=IGNORE_INDEX,
        z_loss=z_loss, vocab_start=vocab_start, reduce=reduce,
    )
