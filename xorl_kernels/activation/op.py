"""SwiGLU activation ``swiglu(gate, up) = silu(gate) * up`` (the middle of a SwiGLU MLP).

``gate`` / ``up`` [..., units], same shape and dtype; they may be strided views (the interleaved
halves of a merged gate_up projection: ``gate_up.view(..., units, 2)[..., 0]`` and ``[..., 1]``),
which the Triton kernel reads in place. Differentiable in both.

Custom ops ``xorl::swiglu`` / ``xorl::swiglu_backward``, so a compiled block stays one graph;
selective checkpointing recomputes them. Dispatch (xorl_kernels.dispatch): Triton on CUDA
tensors, the plain-torch reference on CPU.
"""

from __future__ import annotations

import torch

from xorl_kernels.activation.reference import (
    clamped_swiglu_backward_reference,
    clamped_swiglu_reference,
    swiglu_backward_reference,
    swiglu_reference,
)
from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting

_AVAILABLE = (TRITON, REFERENCE)


def _resolve(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend("swiglu", [x], _AVAILABLE, backend)
    if backend is None and x.dtype == torch.float64:
        return REFERENCE
    if chosen == TRITON and not x.is_cuda and not triton_interpreting():
        raise RuntimeError("swiglu: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (or backend='reference')")
    return chosen


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # a view for the merged gate_up halves (leading dims contiguous)


@torch.library.custom_op("xorl::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, backend: str | None) -> torch.Tensor:
    if _resolve(backend, gate) == REFERENCE:
        return swiglu_reference(gate, up).contiguous()
    from xorl_kernels.activation.triton_kernels import swiglu_forward_triton

    return swiglu_forward_triton(_rows(gate), _rows(up)).view(gate.shape)


@_swiglu_op.register_fake
def _(gate, up, backend):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("xorl::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                        backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if _resolve(backend, gate) == REFERENCE:
        dg, du = swiglu_backward_reference(dy, gate, up)
        return dg.contiguous(), du.contiguous()
    from xorl_kernels.activation.triton_kernels import swiglu_backward_triton

    dg, du = swiglu_backward_triton(_rows(dy), _rows(gate), _rows(up))
    return dg.view(gate.shape), du.view(up.shape)


@_swiglu_backward_op.register_fake
def _(dy, gate, up, backend):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _setup(ctx, inputs, output):
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.xorl.swiglu_backward(dy, gate, up, ctx.backend)
    return dg, du, None


_swiglu_op.register_autograd(_backward, setup_context=_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up; see the module docstring."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return torch.ops.xorl.swiglu(gate, up, backend)


@torch.library.custom_op("xorl::clamped_swiglu", mutates_args=())
def _clamped_swiglu_op(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
                       backend: str | None) -> torch.Tensor:
    if _resolve(backend, gate) == REFERENCE:
        return clamped_swiglu_reference(gate, up, alpha, limit).contiguous()
    from xorl_kernels.activation.triton_kernels import clamped_swiglu_forward_triton

    return clamped_swiglu_forward_triton(_rows(gate), _rows(up), alpha, limit).view(gate.shape)


@_clamped_swiglu_op.register_fake
def _(gate, up, alpha, limit, backend):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("xorl::clamped_swiglu_backward", mutates_args=())
def _clamped_swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
                                backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if _resolve(backend, gate) == REFERENCE:
        dg, du = clamped_swiglu_backward_reference(dy, gate, up, alpha, limit)
        return dg.contiguous(), du.contiguous()
    from xorl_kernels.activation.triton_kernels import clamped_swiglu_backward_triton

    dg, du = clamped_swiglu_backward_triton(_rows(dy), _rows(gate), _rows(up), alpha, limit)
    return dg.view(gate.shape), du.view(up.shape)


@_clamped_swiglu_backward_op.register_fake
def _(dy, gate, up, alpha, limit, backend):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _clamped_setup(ctx, inputs, output):
    gate, up, ctx.alpha, ctx.limit, ctx.backend = inputs
    ctx.save_for_backward(gate, up)


def _clamped_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.xorl.clamped_swiglu_backward(dy, gate, up, ctx.alpha, ctx.limit, ctx.backend)
    return dg, du, None, None, None


_clamped_swiglu_op.register_autograd(_clamped_backward, setup_context=_clamped_setup)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, *,
                   backend: str | None = None) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``, with
    ``g = gate.clamp(max=limit)`` (transformers' GptOssExperts._apply_gate). One fused kernel (Triton
    on CUDA, like ``swiglu``: strided halves read in place), the plain-torch reference on CPU."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"clamped_swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} must match")
    return torch.ops.xorl.clamped_swiglu(gate, up, float(alpha), float(limit), backend)
