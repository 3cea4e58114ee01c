"""Plain-torch references of the three MoE row moves (also the CPU path of permute / unpermute).

- ``permute_rows_reference(x [T, H], src_row [R]) -> [R, H]``: ``out[r] = x[src_row[r]]``, a zero
  row for an index outside [0, T); with src_row = sorted_tokens this is the MoE permute.
- ``unpermute_combine_reference(y [R, H], row_of_slot [T, K], weights [T, K] or None) -> [T, H]``:
  ``out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]]`` accumulated in fp32 (fp64 for fp64
  inputs) in k order, in y's dtype; a row index outside [0, R) contributes nothing (a dropped slot).
- ``scatter_weighted_reference``: the backward of the combine (rows scattered back, weighted, and
  the weight gradient as a dot per slot).

The csrc kernels (moe_permute/csrc.py) and Triton kernels (moe_permute/triton_kernels.py) are
checked against these. None of them reads a device value on the host.
"""

from __future__ import annotations

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 accumulation for every training dtype; float64 stays float64 (test references)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def permute_rows_reference(x: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
    """out[r] = x[src_row[r]]; an index outside [0, T) gives a zero row."""
    valid = (src_row >= 0) & (src_row < x.shape[0])
    out = x.index_select(0, torch.where(valid, src_row, torch.zeros_like(src_row)))
    return out.masked_fill_(~valid.unsqueeze(1), 0)


def unpermute_combine_reference(
    y: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]] in fp32 (fp64) in k order, in y's dtype.

    ``weights=None`` means 1. The explicit k loop fixes the summation order, so every backend
    adds the same terms in the same order.
    """
    acc = acc_dtype(y)
    valid = (row_of_slot >= 0) & (row_of_slot < y.shape[0])
    safe = torch.where(valid, row_of_slot, torch.zeros_like(row_of_slot))
    w = valid.to(acc) if weights is None else torch.where(valid, weights.to(acc), torch.zeros((), dtype=acc))
    out = torch.zeros(row_of_slot.shape[0], y.shape[1], dtype=acc, device=y.device)
    for k in range(row_of_slot.shape[1]):
        out += w[:, k : k + 1] * y.index_select(0, safe[:, k]).to(acc)
    return out.to(y.dtype)


def scatter_weighted_reference(grad_y, row_map, weights, y_sorted, need_weight_grad: bool, out=None):
    """Backward of the combine: (grad_y_sorted, grad_weights [T, K] or None).

    grad_y_sorted[row_map[t, k]] = weights[t, k] * grad_y[t]; grad_weights[t, k] =
    <grad_y[t], y_sorted[row_map[t, k]]>. ``out``: where grad_y_sorted goes (allocated if None).
    """
    num_tokens, top_k = row_map.shape
    acc = acc_dtype(y_sorted)
    g = grad_y.to(acc).unsqueeze(1).expand(num_tokens, top_k, grad_y.shape[-1])
    scaled = g * weights.to(acc).unsqueeze(-1) if weights is not None else g
    if out is None:
        out = torch.empty((row_map.numel(), grad_y.shape[-1]), dtype=y_sorted.dtype, device=grad_y.device)
    out.index_copy_(0, row_map.reshape(-1), scaled.reshape(-1, grad_y.shape[-1]).to(y_sorted.dtype))
    grad_w = None
    if need_weight_grad:
        rows = y_sorted.index_select(0, row_map.reshape(-1)).view(num_tokens, top_k, y_sorted.shape[1]).to(acc)
        grad_w = (rows * g).sum(-1)
    return out, grad_w
