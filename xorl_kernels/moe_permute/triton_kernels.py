"""Triton kernels for token permute / unpermute (the op contract is in moe_permute/op.py).

Three row movements, one program per destination row looping over the hidden dim, so every
output element is written by exactly one program (no atomics, deterministic) and the fp32 sums
run in a fixed order. Row offsets are computed in int64. The launchers write into output buffers
the op allocates (so the tests can poison them) and import nothing from the op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, out_ptr, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src_row = tl.load(index_ptr + row).to(tl.int64)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        vals = tl.load(src_ptr + src_row * hidden + cols, mask=mask)
        tl.store(out_ptr + row * hidden + cols, vals, mask=mask)


@triton.jit
def _combine_kernel(
    y_ptr, row_map_ptr, w_ptr, out_ptr, hidden, top_k, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, top_k):
            src_row = tl.load(row_map_ptr + token * top_k + k).to(tl.int64)
            vals = tl.load(y_ptr + src_row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                vals = vals * tl.load(w_ptr + token * top_k + k).to(tl.float32)
            acc += vals
        tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_weighted_kernel(
    grad_y_ptr,
    sorted_slots_ptr,
    w_ptr,
    y_ptr,
    grad_sorted_ptr,
    grad_w_ptr,
    hidden,
    top_k,
    HAS_WEIGHTS: tl.constexpr,
    NEED_W_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(sorted_slots_ptr + row).to(tl.int64)
    token = slot // top_k
    if HAS_WEIGHTS:
        w = tl.load(w_ptr + slot).to(tl.float32)
    else:
        w = 1.0
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        g = tl.load(grad_y_ptr + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            grad_sorted_ptr + row * hidden + cols, (g * w).to(grad_sorted_ptr.dtype.element_ty), mask=mask
        )
        if NEED_W_GRAD:
            y = tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            dot += g * y
    if NEED_W_GRAD:
        tl.store(grad_w_ptr + slot, tl.sum(dot, axis=0))


def _block(hidden: int) -> int:
    return min(triton.next_power_of_2(max(hidden, 16)), 2048)


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = src[index[r]]; src [N, H] contiguous, index [M] int64, out [M, H]."""
    hidden = src.shape[1]
    if out.numel():
        block = _block(hidden)
        _gather_rows_kernel[(index.numel(),)](src, index, out, hidden, BLOCK=block, num_warps=_warps(block))
    return out


def combine(
    y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y_sorted[row_map[t, k]] (fp32 accumulate, k order); out [T, H]."""
    num_tokens, top_k = row_map.shape
    hidden = y_sorted.shape[1]
    if out.numel():
        block = _block(hidden)
        w = weights if weights is not None else row_map  # placeholder pointer, never read
        _combine_kernel[(num_tokens,)](
            y_sorted,
            row_map,
            w,
            out,
            hidden,
            top_k,
            HAS_WEIGHTS=weights is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return out


def scatter_weighted(
    grad_y: torch.Tensor,
    sorted_slots: torch.Tensor,
    weights: torch.Tensor | None,
    y_sorted: torch.Tensor,
    grad_sorted: torch.Tensor,
    grad_w: torch.Tensor | None,
):
    """Backward of combine into grad_sorted [T*K, H] and grad_w [T*K] fp32 (None: not needed):
    grad_sorted[r] = w[slot] * grad_y[slot // K]; grad_w[slot] = <grad_y, y>."""
    rows = sorted_slots.numel()
    hidden = grad_y.shape[1]
    top_k = rows // grad_y.shape[0] if grad_y.shape[0] else 1
    need_weight_grad = grad_w is not None
    if rows and hidden:
        block = _block(hidden)
        w = weights if weights is not None else sorted_slots
        _scatter_weighted_kernel[(rows,)](
            grad_y,
            sorted_slots,
            w,
            y_sorted,
            grad_sorted,
            grad_w if grad_w is not None else grad_sorted,
            hidden,
            top_k,
            HAS_WEIGHTS=weights is not None,
            NEED_W_GRAD=need_weight_grad,
            BLOCK=block,
            num_warps=_warps(block),
        )
    elif grad_w is not None:
        grad_w.zero_()
    if grad_w is not None:
        grad_w = grad_w.view(grad_y.shape[0], -1)
    return grad_sorted, grad_w
