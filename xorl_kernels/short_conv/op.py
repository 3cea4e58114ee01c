"""The short depthwise causal convolution of linear-attention layers (Gated DeltaNet's conv1d), differentiable.

    y = causal_conv1d(x, weight, bias=None, activation="silu", cu_seqlens=None, initial_state=None)

    y[t, d] = act(bias[d] + sum_i weight[d, i] * x[t - (W-1) + i, d])

- x [batch, seq, dim] (token-major, the layout the layer's projections produce; transformers'
  causal_conv1d_fn takes the transpose); weight [dim, W] or nn.Conv1d's [dim, 1, W]; bias [dim].
- activation: "silu" (= "swish", the Qwen3.5 / Qwen3-Next ``hidden_act``) or None.
- Packed documents: ``cu_seqlens`` (int32/int64 [docs + 1]) with batch 1. Every document starts
  fresh: its first W-1 outputs read ``initial_state`` (or zeros), never the previous document.
- ``initial_state`` [docs or batch, dim, W-1] (causal-conv1d's ``initial_states``): the W-1 inputs
  before each document's start. Context parallelism passes a document's previous shard tail
  here (``x[:, -(W-1):].transpose(1, 2)`` of the rank before) and sends its gradient back.
- y in x's dtype; arithmetic in fp32 (float64 for float64 inputs, reference only).

Custom ops ``xorl::causal_conv1d`` / ``xorl::causal_conv1d_backward`` with fake impls and a
registered backward. Dispatch (xorl_kernels.dispatch): Triton on CUDA tensors (triton_kernels.py),
the plain-torch reference on CPU (reference.py).
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting
from xorl_kernels.doc_chunks import check_cu_seqlens, doc_chunks
from xorl_kernels.short_conv.reference import (
    ACTIVATIONS,
    causal_conv1d_backward_reference,
    causal_conv1d_forward_reference,
)

_OP = "causal_conv1d"
_AVAILABLE = (TRITON, REFERENCE)
MAX_WIDTH = 8  # the taps are unrolled in the Triton kernels


def _resolve(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend(_OP, [x], _AVAILABLE, backend)
    if chosen == TRITON and x.dtype == torch.float64:
        if backend is None:
            return REFERENCE
        raise TypeError(f"{_OP}: the Triton backend takes fp16/bf16/fp32; use backend='reference' for float64")
    if chosen == TRITON and not x.is_cuda and not triton_interpreting():
        raise RuntimeError(f"{_OP}: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (or backend='reference')")
    return chosen


def _host_cu(cu_seqlens, batch, seq):
    if cu_seqlens is None:
        return torch.arange(0, batch + 1, dtype=torch.int64) * seq
    return check_cu_seqlens(_OP, cu_seqlens, seq)


def _chunks(x, cu_seqlens):
    from xorl_kernels.short_conv.triton_kernels import token_block

    return doc_chunks(_OP, cu_seqlens, x.shape[0], x.shape[1], token_block(), x.device)


@torch.library.custom_op("xorl::causal_conv1d", mutates_args=())
def _conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_state: torch.Tensor | None,
             cu_seqlens: torch.Tensor | None, activation: str | None, backend: str | None) -> torch.Tensor:
    batch, seq, dim = x.shape
    xp = x.reshape(batch * seq, dim).contiguous()
    init = initial_state.contiguous() if initial_state is not None else None
    if _resolve(backend, x) == REFERENCE:
        y = causal_conv1d_forward_reference(xp, weight, bias, activation, init, _host_cu(cu_seqlens, batch, seq))
    else:
        from xorl_kernels.short_conv.triton_kernels import causal_conv1d_forward_triton

        y = causal_conv1d_forward_triton(xp, weight.contiguous(), bias, activation is not None, init,
                                         _chunks(x, cu_seqlens))
    return y.view(x.shape)


@_conv_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, activation, backend):
    return torch.empty_like(x)


@torch.library.custom_op("xorl::causal_conv1d_backward", mutates_args=())
def _conv_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, activation: str | None,
                      backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, d_initial_state); dbias / d_initial_state are empty when absent."""
    batch, seq, dim = x.shape
    xp, dyp = x.reshape(batch * seq, dim).contiguous(), dy.reshape(batch * seq, dim).contiguous()
    init = initial_state.contiguous() if initial_state is not None else None
    if _resolve(backend, x) == REFERENCE:
        dx, dw, db, d_init = causal_conv1d_backward_reference(dyp, xp, weight, bias, activation, init,
                                                              _host_cu(cu_seqlens, batch, seq))
    else:
        from xorl_kernels.short_conv.triton_kernels import causal_conv1d_backward_triton

        dx, dw, db, d_init = causal_conv1d_backward_triton(dyp, xp, weight.contiguous(), bias, activation is not None,
                                                           init, _chunks(x, cu_seqlens))
    return (dx.view(x.shape), dw, db if db is not None else x.new_empty(0),
            d_init if d_init is not None else x.new_empty(0))


@_conv_backward_op.register_fake
def _(dy, x, weight, bias, initial_state, cu_seqlens, activation, backend):
    return (torch.empty_like(x), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty(0),
            torch.empty_like(initial_state) if initial_state is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, cu_seqlens, activation, backend = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
    ctx.options = (activation, backend)


def _backward(ctx, dy):
    x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
    dx, dw, db, d_init = torch.ops.xorl.causal_conv1d_backward(dy, x, weight, bias, initial_state, cu_seqlens,
                                                                *ctx.options)
    return (dx, dw, db if bias is not None else None, d_init if initial_state is not None else None, None, None,
            None)


_conv_op.register_autograd(_backward, setup_context=_setup_context)


def causal_conv1d(x, weight, bias=None, activation="silu", cu_seqlens=None, initial_state=None, *, backend=None):
    """y [batch, seq, dim] in x's dtype, differentiable w.r.t. x, weight, bias and initial_state.
    See the module docstring."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)  # nn.Conv1d(groups=dim).weight
    if x.dim() != 3:
        raise ValueError(f"{_OP}: x must be [batch, seq, dim], got {tuple(x.shape)}")
    dim = x.shape[2]
    if weight.dim() != 2 or weight.shape[0] != dim or not 1 <= weight.shape[1] <= MAX_WIDTH:
        raise ValueError(f"{_OP}: weight must be [dim={dim}, W] with 1 <= W <= {MAX_WIDTH}, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"{_OP}: bias must be [{dim}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"{_OP}: with cu_seqlens the batch dim must be 1 (packed documents), got {x.shape[0]}")
    if initial_state is not None:
        docs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        want = (docs, dim, weight.shape[1] - 1)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"{_OP}: initial_state must be [docs, dim, W-1] = {want}, got {tuple(initial_state.shape)}")
    if any(t is not None and t.device != x.device for t in (weight, bias, initial_state)):
        raise ValueError(f"{_OP}: x, weight, bias and initial_state must be on one device")
    return torch.ops.xorl.causal_conv1d(x, weight, bias, initial_state, cu_seqlens,
                                        "silu" if activation == "swish" else activation, backend)
