"""Plain-torch versions of the two per-chunk steps of the fused linear cross-entropy (the CPU path).

``chunk_stats_reference(logits, labels, vocab_start)`` -> (row_max, sum_exp, target) in fp32, each
[rows]: the max over this shard's columns, sum(exp(logit - row_max)) and the logit of the label when
the label's column ``labels - vocab_start`` lies in this shard (0 otherwise).

``chunk_grad_reference(logits, labels, vocab_start, lse, row_scale, z_loss)`` -> d loss / d logits in
the logits' dtype: ``(softmax * (1 + 2 z lse) - onehot(label)) * row_scale`` with
``softmax = exp(logit - lse)``; ``row_scale`` is 0 on ignored tokens.
"""

from __future__ import annotations

import torch


def _target_column(labels: torch.Tensor, vocab_start: int, width: int):
    local = labels - vocab_start
    mine = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), mine


def chunk_stats_reference(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int):
    x = logits.float()
    row_max = x.max(dim=-1).values
    sum_exp = (x - row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    column, mine = _target_column(labels, vocab_start, x.shape[-1])
    target = x.gather(-1, column.unsqueeze(-1)).squeeze(-1) * mine
    return row_max, sum_exp, target


def chunk_grad_reference(logits, labels, vocab_start: int, lse, row_scale, z_loss: float):
    x = logits.float()
    grad = (x - lse.unsqueeze(-1)).exp_()
    grad.mul_((row_scale * (1.0 + 2.0 * z_loss * lse)).unsqueeze(-1))
    column, mine = _target_column(labels, vocab_start, x.shape[-1])
    grad.scatter_add_(-1, column.unsqueeze(-1), -(row_scale * mine).unsqueeze(-1))
    return grad.to(logits.dtype)


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index: int = -100, z_loss: float = 0.0):
    """The unfused formula on whole logits (tests): sum over label tokens of lse - target + z lse^2."""
    logits = (hidden @ weight.T).float()
    lse = logits.logsumexp(-1)
    valid = labels != ignore_index
    target = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return ((lse - target + z_loss * lse * lse) * valid).sum()
