"""Rotary position embedding of q or k: ``apply_rotary(x, cos, sin)``.

``x`` [batch, seq, heads, head_dim]; ``cos`` / ``sin`` [batch, seq, rot] with rot <= head_dim (even;
rot < head_dim is partial rotary) precomputed by the caller, so every RoPE variant (default,
linear, dynamic, llama3, yarn, longrope) is a choice of tables. Rotate-half layout (transformers').
Differentiable in x (cos / sin are constants of the positions).

Custom op ``xorl::rope`` (forward and, with ``backward=True``, the inverse rotation that is its
gradient), so a compiled block stays one graph; selective checkpointing recomputes it. Dispatch
(xorl_kernels.dispatch): Triton on CUDA tensors, the plain-torch reference on CPU.
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting
from xorl_kernels.rope.reference import rope_backward_reference, rope_reference

_AVAILABLE = (TRITON, REFERENCE)


def _resolve(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend("rope", [x], _AVAILABLE, backend)
    if backend is None and x.dtype == torch.float64:
        return REFERENCE
    if chosen == TRITON and not x.is_cuda and not triton_interpreting():
        raise RuntimeError("rope: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (or backend='reference')")
    return chosen


@torch.library.custom_op("xorl::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
             backend: str | None) -> torch.Tensor:
    if _resolve(backend, x) == REFERENCE:
        return (rope_backward_reference if backward else rope_reference)(x, cos, sin)
    from xorl_kernels.rope.triton_kernels import rope_triton

    b, s = x.shape[:2]
    cos = cos.expand(b, s, cos.shape[-1]).contiguous()
    sin = sin.expand(b, s, sin.shape[-1]).contiguous()
    return rope_triton(x.contiguous(), cos, sin, backward=backward)


@_rope_op.register_fake
def _(x, cos, sin, backward, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    _, cos, sin, backward, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward, ctx.backend = backward, backend


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return torch.ops.xorl.rope(dy, cos, sin, not ctx.backward, ctx.backend), None, None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of each head of ``x``; see the module docstring."""
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(
            f"apply_rotary: x must be [batch, seq, heads, head_dim] and cos / sin [batch, seq, rot], got "
            f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1] or cos.shape[1] != x.shape[1] or cos.shape[0] not in (1, x.shape[0]):
        raise ValueError(
            f"apply_rotary: cos / sin {tuple(cos.shape)} do not fit x {tuple(x.shape)} (rot must be even and "
            "<= head_dim, seq equal, batch 1 or equal)"
        )
    return torch.ops.xorl.rope(x, cos, sin, False, backend)
