"""Plain-torch grouped GEMM: the reference every kernel is checked against, and the CPU path.

``y[rows of g] = x[rows of g] @ w[g]`` with x's rows sorted by group and ``group_sizes[g]`` rows
in group g. A per-group Python loop: it reads ``group_sizes`` on the host (a sync on GPU), which
is fine for CPU and debugging and is exactly why the GPU path uses the Triton kernels instead.
``grouped_gemm_weight_grad_reference`` gives ``dw[g] = x_g^T @ dy_g`` the same way (an exact zero
for a group with no rows); dx is ``grouped_gemm_reference(dy, w.transpose(1, 2), group_sizes)``.
With a per-group ``bias`` [G, N] (gpt-oss experts) each row of g gets ``bias[g]`` added, and
``grouped_bias_grad_reference`` gives its gradient ``db[g] = sum of dy's rows of g``.
"""

from __future__ import annotations

import torch

from xorl_kernels.expert_gemm.checks import check_group_sizes_values


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g] (+ bias[g])``; x [M, K], w [G, K, N], group_sizes [G],
    bias [G, N] or None -> y [M, N].

    Products (and the bias add) are computed in float32 (float64 stays float64) and cast back to
    x's dtype once, matching the kernels' fp32 accumulation. Differentiable with respect to x, w, bias.
    """
    sizes = check_group_sizes_values(group_sizes, x.shape[0])
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    pieces = []
    start = 0
    for g, rows in enumerate(sizes):
        x_g = x[start : start + rows].to(compute_dtype)
        y_g = x_g @ w[g].to(compute_dtype)
        pieces.append(y_g if bias is None else y_g + bias[g].to(compute_dtype))
        start += rows
    return torch.cat(pieces, dim=0).to(x.dtype)


def grouped_gemm_weight_grad_reference(
    x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``dw[g] = x[rows of g]^T @ dy[rows of g]``; x [M, K], dy [M, N] -> dw [G, K, N] in ``out_dtype``."""
    sizes = check_group_sizes_values(group_sizes, x.shape[0])
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    dw = torch.zeros(len(sizes), x.shape[1], dy.shape[1], dtype=compute_dtype, device=x.device)
    start = 0
    for g, rows in enumerate(sizes):
        dw[g] = x[start : start + rows].to(compute_dtype).T @ dy[start : start + rows].to(compute_dtype)
        start += rows
    return dw.to(out_dtype)


def grouped_bias_grad_reference(dy: torch.Tensor, group_sizes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``db[g] = sum of dy[rows of g]``; dy [M, N] -> db [G, N] in ``out_dtype`` (zero for an empty group)."""
    sizes = check_group_sizes_values(group_sizes, dy.shape[0])
    compute_dtype = torch.float64 if dy.dtype == torch.float64 else torch.float32
    db = torch.zeros(len(sizes), dy.shape[1], dtype=compute_dtype, device=dy.device)
    start = 0
    for g, rows in enumerate(sizes):
        db[g] = dy[start : start + rows].to(compute_dtype).sum(0)
        start += rows
    return db.to(out_dtype)
