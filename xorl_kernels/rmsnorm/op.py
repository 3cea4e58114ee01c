"""RMSNorm over the last dim, optionally adding a residual first (the fused "add + norm" of a block).

``rms_norm(x, weight, eps)`` -> y (transformers' LlamaRMSNorm: fp32 statistics, the normalised
x rounded to x's dtype, times weight); ``rms_norm(x, weight, eps, residual=r)`` -> (y, h) with
``h = x + r`` (the new residual stream) and ``y = rms_norm(h)``, in one pass over memory.

Custom ops ``xorl::rms_norm`` / ``xorl::add_rms_norm`` with a registered backward
(``xorl::rms_norm_backward``), so a compiled block stays one graph; selective checkpointing
recomputes them (cheap element-wise work; parallel/data_parallel.py saves only matmuls, attention
and collectives). Dispatch (xorl_kernels.dispatch): Triton on CUDA tensors, the plain-torch
reference on CPU.
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting
from xorl_kernels.rmsnorm.reference import rms_norm_backward_reference, rms_norm_reference

_AVAILABLE = (TRITON, REFERENCE)


def _resolve(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend("rms_norm", [x], _AVAILABLE, backend)
    if backend is None and x.dtype == torch.float64:
        return REFERENCE
    if chosen == TRITON and not x.is_cuda and not triton_interpreting():
        raise RuntimeError("rms_norm: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (or backend='reference')")
    return chosen


@torch.library.custom_op("xorl::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    if _resolve(backend, x) == REFERENCE:
        y, rstd = rms_norm_reference(x2d, weight, eps)
    else:
        from xorl_kernels.rmsnorm.triton_kernels import rms_norm_forward_triton

        y, _, rstd = rms_norm_forward_triton(x2d, weight.contiguous(), eps)
    return y.view(x.shape), rstd


@_rms_norm_op.register_fake
def _(x, weight, eps, backend):
    rows = x.numel() // max(x.shape[-1], 1)
    return x.new_empty(x.shape, dtype=torch.result_type(x, weight)), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("xorl::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    r2d = residual.reshape(-1, x.shape[-1]).contiguous()
    if _resolve(backend, x) == REFERENCE:
        h = x2d + r2d
        y, rstd = rms_norm_reference(h, weight, eps)
    else:
        from xorl_kernels.rmsnorm.triton_kernels import rms_norm_forward_triton

        y, h, rstd = rms_norm_forward_triton(x2d, weight.contiguous(), eps, r2d)
    return y.view(x.shape), h.view(x.shape), rstd


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, backend):
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.new_empty(x.shape, dtype=torch.result_type(x, weight)), torch.empty_like(x),
            x.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op("xorl::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    dy2d, x2d = dy.reshape(-1, n).contiguous(), x.reshape(-1, n).contiguous()
    if _resolve(backend, x) == REFERENCE:
        dx, dw = rms_norm_backward_reference(dy2d, x2d, weight, rstd)
    else:
        from xorl_kernels.rmsnorm.triton_kernels import rms_norm_backward_triton

        dx, dw = rms_norm_backward_triton(dy2d, x2d, weight.contiguous(), rstd)
    return dx.view(x.shape), dw


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, backend):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, eps, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend = backend


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.xorl.rms_norm_backward(dy, x, weight, rstd, ctx.backend)
    return dx, dw, None, None


def _add_setup(ctx, inputs, output):
    x, residual, weight, eps, backend = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.backend = backend


def _add_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.xorl.rms_norm_backward(dy, h, weight, rstd, ctx.backend)
    if dh is not None:
        dx = dx + dh  # h = x + residual also feeds the rest of the residual stream
    return dx, dx, dw, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup)
_add_rms_norm_op.register_autograd(_add_backward, setup_context=_add_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             backend: str | None = None):
    """y = RMSNorm(x) (or, with ``residual``, (RMSNorm(x + residual), x + residual)); see the module docstring."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is None:
        return torch.ops.xorl.rms_norm(x, weight, float(eps), backend)[0]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                         f"({tuple(residual.shape)}, {residual.dtype})")
    y, h, _ = torch.ops.xorl.add_rms_norm(x, residual, weight, float(eps), backend)
    return y, h
