"""Merge two partial attention results over disjoint key sets through their log-sum-exp.

    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)

With lse = log Σ exp(scores) over each key set, attention over the union of the key sets is
    lse = log(exp(lse_a) + exp(lse_b)),
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b.
Ring attention folds each step's (out, lse) into a running pair with this. Attention sinks are
not a key set: steps run without them and ``apply_sinks`` (attention/sinks.py) adds them once per
row after the last merge.

Layouts follow ``flash_attn_with_lse``: out [batch, seq, heads, d] with lse [batch, heads, seq],
or out [total, heads, d] with lse [heads, total]. Computed in fp32 (fp64 for fp64 inputs) with the
max subtracted, so huge lse values do not overflow. -inf on either side means "no key seen
there": that side gets weight 0; both -inf gives out = 0 and lse = -inf, with no NaN in the
forward or the backward (the divisions and logs are guarded so their unused branches stay finite).
The returned out has the promoted dtype of out_a and out_b (keep an fp32 running accumulator for
precision), lse is fp32 (fp64 for fp64). Differentiable w.r.t. all four inputs (plain torch
autograd); works on any device.
"""

from __future__ import annotations

import torch


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have the same shape, got {tuple(out_a.shape)}, {tuple(out_b.shape)}")
    if lse_a.shape != lse_b.shape:
        raise ValueError(f"lse_a and lse_b must have the same shape, got {tuple(lse_a.shape)}, {tuple(lse_b.shape)}")
    expected = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3]) if out_a.dim() >= 3 else None
    if expected is None or tuple(lse_a.shape) != expected:
        raise ValueError(
            f"lse must be [..., heads, seq] for out [..., seq, heads, d]: expected {expected}, "
            f"got {tuple(lse_a.shape)}"
        )


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over the union of the key sets behind (out_a, lse_a) and (out_b, lse_b)."""
    _check(out_a, lse_a, out_b, lse_b)
    dtype = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype, out_b.dtype, lse_b.dtype) else torch.float32
    la, lb = lse_a.to(dtype), lse_b.to(dtype)
    top = torch.maximum(la, lb)
    # Both sides -inf: subtract 0 instead of -inf so exp(-inf - 0) = 0 rather than NaN.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    wa = torch.exp(la - top)
    wb = torch.exp(lb - top)
    total = wa + wb
    empty = total == 0
    # Guard the division and the log on empty rows; their results are replaced anyway.
    total_safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), top + torch.log(total_safe))
    scale_a = (wa / total_safe).transpose(-1, -2).unsqueeze(-1)  # [..., seq, heads, 1]
    scale_b = (wb / total_safe).transpose(-1, -2).unsqueeze(-1)
    out = scale_a * out_a.to(dtype) + scale_b * out_b.to(dtype)
    return out.to(torch.promote_types(out_a.dtype, out_b.dtype)), lse
