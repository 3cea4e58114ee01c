"""Gated RMSNorm: ``gated_rms_norm(x, gate, weight, eps)`` = RMSNorm(x) * weight * silu(gate) over the last dim.

Gated DeltaNet's output norm (transformers' Qwen3NextRMSNormGated / Qwen3_5RMSNormGated: norm
before gate, fp32 statistics, the normalised x rounded to x's dtype, times weight, times
silu(gate) in fp32, cast to x's dtype). x and gate share a shape ([..., N]); weight is [N].

Custom ops ``xorl::gated_rms_norm`` / ``xorl::gated_rms_norm_backward`` with fake impls and a
registered backward; one pass over x and gate each way. Dispatch (xorl_kernels.dispatch): Triton
on CUDA tensors (gated_triton.py), the plain-torch reference on CPU (reference.py).
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting
from xorl_kernels.rmsnorm.reference import gated_rms_norm_backward_reference, gated_rms_norm_reference

_OP = "gated_rms_norm"
_AVAILABLE = (TRITON, REFERENCE)


def _resolve(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend(_OP, [x], _AVAILABLE, backend)
    if chosen == TRITON and x.dtype == torch.float64:
        if backend is None:
            return REFERENCE
        raise TypeError(f"{_OP}: the Triton backend takes fp16/bf16/fp32; use backend='reference' for float64")
    if chosen == TRITON and not x.is_cuda and not triton_interpreting():
        raise RuntimeError(f"{_OP}: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (or backend='reference')")
    return chosen


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


@torch.library.custom_op("xorl::gated_rms_norm", mutates_args=())
def _gated_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
              backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if _resolve(backend, x) == REFERENCE:
        y, rstd = gated_rms_norm_reference(_rows(x), _rows(gate), weight, eps)
    else:
        from xorl_kernels.rmsnorm.gated_triton import gated_rms_norm_forward_triton

        y, rstd = gated_rms_norm_forward_triton(_rows(x), _rows(gate), weight.contiguous(), eps)
    return y.view(x.shape), rstd


@_gated_op.register_fake
def _(x, gate, weight, eps, backend):
    rows = x.numel() // max(x.shape[-1], 1)
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("xorl::gated_rms_norm_backward", mutates_args=())
def _gated_backward_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor, backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _resolve(backend, x) == REFERENCE:
        dx, dz, dw = gated_rms_norm_backward_reference(_rows(dy), _rows(x), _rows(gate), weight, rstd)
    else:
        from xorl_kernels.rmsnorm.gated_triton import gated_rms_norm_backward_triton

        dx, dz, dw = gated_rms_norm_backward_triton(_rows(dy), _rows(x), _rows(gate), weight.contiguous(), rstd)
    return dx.view(x.shape), dz.view(gate.shape), dw


@_gated_backward_op.register_fake
def _(dy, x, gate, weight, rstd, backend):
    return torch.empty_like(x), torch.empty_like(gate), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, gate, weight, eps, backend = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.backend = backend


def _backward(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    dx, dz, dw = torch.ops.xorl.gated_rms_norm_backward(dy, x, gate, weight, rstd, ctx.backend)
    return dx, dz, dw, None, None


_gated_op.register_autograd(_backward, setup_context=_setup)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   backend: str | None = None) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate) in x's dtype, differentiable w.r.t. x, gate and weight."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{_OP}: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if gate.shape != x.shape:
        raise ValueError(f"{_OP}: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if gate.device != x.device or weight.device != x.device:
        raise ValueError(f"{_OP}: x, gate and weight must be on one device")
    return torch.ops.xorl.gated_rms_norm(x, gate, weight, float(eps), backend)[0]
