"""Plain-torch float64 references of the FP8 formulas: quantise -> matmul -> dequantise.

Given the fp8 operands and their exact block scales (``quantize.quantize_blocks``), the result of
a scaled GEMM is, elementwise, ``sum_k (qa[m, k] * sa[m, k // bk]) * (qb[n, k] * sb[n // bn, k // bk])``.
These functions evaluate that sum in float64 (every fp8 value and power-of-2 scale is exact
there), so a kernel's error against them is its accumulation error alone. ``fp8_linear_reference``
runs the three GEMMs of a linear layer (forward, input gradient, weight gradient) with the same
quantisations the op uses (``linear.OPERANDS``).
"""

from __future__ import annotations

import torch

from xorl_kernels.fp8.quantize import expand_block_scale, quantize_blocks_reference


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block_rows: int | None,
                         block_cols: int | None) -> torch.Tensor:
    """q [R, C] fp8 and its block scales -> the float64 values q * scale."""
    rows, cols = q.shape
    br = rows if block_rows is None else min(block_rows, rows)
    bc = cols if block_cols is None else min(block_cols, cols)
    full = expand_block_scale(expand_block_scale(scale.double(), br, rows, 0), bc, cols, 1)
    return q.double() * full


def scaled_mm_nt_reference(qa, sa, a_block, qb, sb, b_block) -> torch.Tensor:
    """float64 ``(qa * sa) @ (qb * sb)^T`` for qa [M, K], qb [N, K]; ``*_block`` = (rows, cols) of a block."""
    return dequantize_reference(qa, sa, *a_block) @ dequantize_reference(qb, sb, *b_block).t()


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor | None, recipe: str):
    """float64 (y, dx, dw) of ``y = x @ w^T`` computed as the op's FP8 recipe prescribes.

    x [M, K], w [N, K], dy [M, N] (None: forward only). Each operand is quantised with the
    recipe's block shape and dtype (``linear.OPERANDS``), then the formula is evaluated in float64.
    """
    from xorl_kernels.fp8.linear import OPERANDS

    def operand(t, role):
        block, dtype = OPERANDS[recipe][role]
        q, s = quantize_blocks_reference(t, *block, dtype)
        return q, s, block

    y = scaled_mm_nt_reference(*operand(x, "x"), *operand(w, "w"))
    if dy is None:
        return y, None, None
    dx = scaled_mm_nt_reference(*operand(dy, "dy"), *operand(w.t(), "w_t"))
    dw = scaled_mm_nt_reference(*operand(dy.t(), "dy_t"), *operand(x.t(), "x_t"))
    return y, dx, dw


def blockwise_grouped_reference(qa, sa, qb, sb, group_sizes, sb_block_n: int = 128) -> torch.Tensor:
    """float64 ``(qa * sa)[rows of g] @ (qb[g] * sb[g])`` for the grouped kernel's operands:
    qa [M, K] with sa [M, ceil(K/128)]; qb [G, K, N] with sb [G, ceil(K/128), ceil(N/sb_block_n)]."""
    a = dequantize_reference(qa, sa, 1, 128)
    out = torch.zeros(qa.shape[0], qb.shape[2], dtype=torch.float64, device=qa.device)
    start = 0
    for g, rows in enumerate(group_sizes.tolist()):
        b = dequantize_reference(qb[g], sb[g], 128, sb_block_n)
        out[start:start + rows] = a[start:start + rows] @ b
        start += rows
    return out


def blockwise_grouped_wgrad_reference(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor,
                                      tile: int = 128) -> torch.Tensor:
    """float64 ``dw[g] = sum over token tiles t of g: (x_t^T quantised) @ (dy_t quantised)`` -> [G, K, N].

    DeepSeek-V3's weight-gradient recipe written out tile by tile: each expert's tokens cut into
    ``tile``-token tiles from its first row (the last one partial), each tile's x^T and dy^T
    quantised to e4m3 with one scale per row (per feature, over the tile's tokens), the dequantised
    products summed in float64. Independent of the kernels' tile bookkeeping
    (``quantize.group_token_tiles``): only ``quantize_blocks_reference`` is shared.
    """
    dw = torch.zeros(group_sizes.numel(), x.shape[1], dy.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, rows in enumerate(group_sizes.tolist()):
        for first in range(0, rows, tile):
            tokens = slice(start + first, start + min(first + tile, rows))
            qa, sa = quantize_blocks_reference(x[tokens].t(), 1, None)
            qb, sb = quantize_blocks_reference(dy[tokens].t(), 1, None)
            dw[g] += dequantize_reference(qa, sa, 1, None) @ dequantize_reference(qb, sb, 1, None).t()
        start += rows
    return dw
