"""Triton RMSNorm forward / backward (optionally adding a residual first), one row per program.

Forward reads x (and the residual), writes y, the sum h = x + residual (when given) and the row's
rstd (fp32, kept for backward): one HBM round trip instead of the eager chain's four or five.
Backward re-reads x (h) and dy, writes dx and a per-program partial of dweight over a block of
rows; the partials are summed in fp32 by torch (a [programs, N] buffer, programs ~ 4 x SMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting


@triton.jit
def _fwd_kernel(x_ptr, res_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps,
                HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as the eager add
        tl.store(h_ptr + row * n_cols + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x_hat = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (x_hat * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, rows_per_program,
                BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (start + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            g = dy * w
            dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)


def _programs(rows: int, device) -> int:
    if triton_interpreting() or device.type != "cuda":
        return max(1, min(rows, 4))
    return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


def rms_norm_forward_triton(x2d, weight, eps: float, residual2d=None):
    """x2d [rows, N] contiguous -> (y, h or None, rstd)."""
    rows, n = x2d.shape
    y = torch.empty(rows, n, dtype=torch.result_type(x2d, weight), device=x2d.device)
    h = torch.empty_like(x2d) if residual2d is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    if rows:
        _fwd_kernel[(rows,)](x2d, residual2d if residual2d is not None else x2d, h if h is not None else x2d,
                             weight, y, rstd, n, eps, HAS_RESIDUAL=residual2d is not None,
                             BLOCK=triton.next_power_of_2(n))
    return y, h, rstd


def rms_norm_backward_triton(dy2d, x2d, weight, rstd):
    rows, n = x2d.shape
    dx = torch.empty_like(x2d)
    programs = _programs(rows, x2d.device)
    per = triton.cdiv(rows, programs) if rows else 1
    partial = torch.zeros(programs, n, dtype=torch.float32, device=x2d.device)
    if rows:
        _bwd_kernel[(programs,)](dy2d, x2d, weight, rstd, dx, partial, rows, n, per,
                                 BLOCK=triton.next_power_of_2(n))
    return dx, partial.sum(0).to(weight.dtype)
