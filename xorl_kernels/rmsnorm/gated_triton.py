"""Triton gated RMSNorm, ``rms_norm(x) * weight * silu(gate)`` (Gated DeltaNet's output norm), one row
per program, forward and backward; the structure of triton_kernels.py (the plain RMSNorm) with the
gate read in the same pass. Rounding follows transformers: the normalised x is rounded to x's dtype
and times weight rounded to the product's dtype before the fp32 gate multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.rmsnorm.triton_kernels import _programs


@triton.jit
def _fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, NORMED_TY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    x_hat = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    normed = (x_hat * w).to(NORMED_TY).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (normed * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, z_ptr, w_ptr, rstd_ptr, dx_ptr, dz_ptr, dw_part_ptr, n_rows, n_cols,
                rows_per_program, BLOCK: tl.constexpr):
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
            z = tl.load(z_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            sig = tl.sigmoid(z)
            d_normed = dy * z * sig
            g = d_normed * w
            dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
            dz = dy * x_hat * w * sig * (1.0 + z * (1.0 - sig))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dz_ptr + row * n_cols + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)
            dw += d_normed * x_hat
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)


def alloc_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised kernel output; the tests replace this to hand the kernels NaN-poisoned buffers."""
    return torch.empty(shape, dtype=dtype, device=device)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def gated_rms_norm_forward_triton(x2d, z2d, weight, eps: float):
    """x2d, z2d [rows, N] contiguous -> (y in x's dtype, rstd fp32 [rows])."""
    rows, n = x2d.shape
    y = alloc_output(x2d.shape, x2d.dtype, x2d.device)
    rstd = alloc_output((rows,), torch.float32, x2d.device)
    if rows:
        _fwd_kernel[(rows,)](x2d, z2d, weight, y, rstd, n, eps, NORMED_TY=_TL[torch.result_type(x2d, weight)],
                             BLOCK=triton.next_power_of_2(n))
    return y, rstd


def gated_rms_norm_backward_triton(dy2d, x2d, z2d, weight, rstd):
    """(dx, dgate, dweight)."""
    rows, n = x2d.shape
    dx, dz = alloc_output(x2d.shape, x2d.dtype, x2d.device), alloc_output(z2d.shape, z2d.dtype, z2d.device)
    programs = _programs(rows, x2d.device)
    per = triton.cdiv(rows, programs) if rows else 1
    partial = torch.zeros(programs, n, dtype=torch.float32, device=x2d.device)
    if rows:
        _bwd_kernel[(programs,)](dy2d, x2d, z2d, weight, rstd, dx, dz, partial, rows, n, per,
                                 BLOCK=triton.next_power_of_2(n))
    return dx, dz, partial.sum(0).to(weight.dtype)
