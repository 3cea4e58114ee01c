"""Triton SwiGLU forward / backward: element-wise over [rows, units] with any row / unit strides, so
the interleaved ``gate_up`` projection of a merged MLP (gate and up units alternating) is read in
place without splitting it first. fp32 arithmetic, one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, dy_ptr, out_ptr, dg_ptr, du_ptr, n_cols, g_rs, g_cs, u_rs, u_cs,
                   BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_rs + cols * g_cs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_rs + cols * u_cs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    if BACKWARD:
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dg_ptr + row * n_cols + cols, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(du_ptr + row * n_cols + cols, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, (g * s * u).to(out_ptr.dtype.element_ty), mask=mask)


def _block(n: int) -> int:
    return 32 if triton_interpreting() else min(1024, triton.next_power_of_2(n))


def _launch(gate2d, up2d, dy2d, out, dg, du, backward: bool):
    rows, n = gate2d.shape
    block = _block(n)
    if rows and n:
        _swiglu_kernel[(rows, triton.cdiv(n, block))](
            gate2d, up2d, dy2d if dy2d is not None else gate2d, out if out is not None else gate2d,
            dg if dg is not None else gate2d, du if du is not None else gate2d, n,
            gate2d.stride(0), gate2d.stride(1), up2d.stride(0), up2d.stride(1), BACKWARD=backward, BLOCK=block,
        )


def swiglu_forward_triton(gate2d, up2d):
    out = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
    _launch(gate2d, up2d, None, out, None, None, backward=False)
    return out


def swiglu_backward_triton(dy2d, gate2d, up2d):
    dg = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
    du = torch.empty(up2d.shape, dtype=up2d.dtype, device=up2d.device)
    _launch(gate2d, up2d, dy2d.contiguous(), None, dg, du, backward=True)
    return dg, du


@triton.jit
def _clamped_swiglu_kernel(g_ptr, u_ptr, dy_ptr, out_ptr, dg_ptr, du_ptr, n_cols, g_rs, g_cs, u_rs, u_cs, alpha, limit,
                           BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """gpt-oss: (clamp(u, -l, l) + 1) * gc * sigmoid(alpha * gc), gc = min(g, l); the clamps pass the
    gradient where they do not cut (bounds inclusive, as torch.clamp's backward)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_rs + cols * g_cs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_rs + cols * u_cs, mask=mask, other=0.0).to(tl.float32)
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(alpha * gc)
    glu = gc * s
    if BACKWARD:
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dg = tl.where(g <= limit, dy * (uc + 1.0) * (s + alpha * glu * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dy * glu, 0.0)
        tl.store(dg_ptr + row * n_cols + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + row * n_cols + cols, du.to(du_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, ((uc + 1.0) * glu).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_clamped(gate2d, up2d, dy2d, out, dg, du, alpha: float, limit: float, backward: bool):
    rows, n = gate2d.shape
    block = _block(n)
    if rows and n:
        _clamped_swiglu_kernel[(rows, triton.cdiv(n, block))](
            gate2d, up2d, dy2d if dy2d is not None else gate2d, out if out is not None else gate2d,
            dg if dg is not None else gate2d, du if du is not None else gate2d, n,
            gate2d.stride(0), gate2d.stride(1), up2d.stride(0), up2d.stride(1), float(alpha), float(limit),
            BACKWARD=backward, BLOCK=block,
        )


def clamped_swiglu_forward_triton(gate2d, up2d, alpha: float, limit: float):
    out = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
    _launch_clamped(gate2d, up2d, None, out, None, None, alpha, limit, backward=False)
    return out


def clamped_swiglu_backward_triton(dy2d, gate2d, up2d, alpha: float, limit: float):
    dg = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
    du = torch.empty(up2d.shape, dtype=up2d.dtype, device=up2d.device)
    _launch_clamped(gate2d, up2d, dy2d.contiguous(), None, dg, du, alpha, limit, backward=True)
    return dg, du
