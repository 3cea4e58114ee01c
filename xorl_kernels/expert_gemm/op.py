"""Grouped GEMM for MoE experts: ``y[rows of g] = x[rows of g] @ w[g]``, differentiable in x and w.

Public entry point ``grouped_gemm(x, w, group_sizes)``:

- ``x`` [M, K]: token rows sorted by group (expert); ``w`` [G, K, N] ("in, out" layout);
  ``group_sizes`` [G] int32/int64 on the same device as x, ``group_sizes[g]`` rows belong to g.
- returns ``y`` [M, N] in x's dtype (bf16 / fp16 / fp32; products accumulate in fp32).
- backward: ``dx[rows of g] = dy[rows of g] @ w[g]^T`` and ``dw[g] = x_g^T @ dy_g`` (exactly zero
  for a group with no rows).
- optional ``bias`` [G, N] (gpt-oss's per-expert biases): ``y[rows of g] += bias[g]``, added to the
  fp32 accumulator; its gradient ``db[g]`` is the sum of dy's rows of g. A separate op
  (``xorl::grouped_gemm_bias``), so the bias-free op and its kernels are untouched.

Dispatch (xorl_kernels.dispatch): CUDA tensors -> Triton kernels (expert_gemm/triton_kernels.py);
CPU tensors -> the plain-torch reference (expert_gemm/reference.py). ``XORL_FORCE_REFERENCE=1``
forces the reference; ``backend="triton"`` forces Triton (on CPU this needs ``TRITON_INTERPRET=1``
set before triton is imported; the tests run that way). The op is registered as ``xorl::grouped_gemm``.

Validation of ``group_sizes`` values (no negative size, ``sum == M``) happens wherever it costs no
device sync: always when group_sizes is on the CPU. On the GPU the kernels read the sizes on the
device and never sync, so the values are trusted there: sizes are clamped at 0 and rows past M
are never touched (no out-of-bounds access), but a sum smaller than M leaves the trailing rows
of ``y`` unwritten. Set ``XORL_CHECK_GROUP_SIZES=1`` to check them on the GPU too (one sync per
call; for debugging).
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, env_flag, pick_backend, triton_interpreting
from xorl_kernels.expert_gemm.checks import check_group_sizes_values
from xorl_kernels.expert_gemm.reference import (
    grouped_bias_grad_reference,
    grouped_gemm_reference,
    grouped_gemm_weight_grad_reference,
)
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

_AVAILABLE = (TRITON, REFERENCE)
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_REFERENCE_DTYPES = (*_TRITON_DTYPES, torch.float64)


def _check_inputs(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> None:
    """Shape / dtype / device checks that need no device sync."""
    for name, t in (("x", x), ("w", w), ("group_sizes", group_sizes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_gemm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"grouped_gemm: x must be 2-D [tokens, in_features], got shape {tuple(x.shape)}; "
            "flatten the leading dimensions first (x.reshape(-1, x.shape[-1]))"
        )
    if w.dim() != 3:
        raise ValueError(f"grouped_gemm: w must be 3-D [groups, in_features, out_features], got shape {tuple(w.shape)}")
    if group_sizes.dim() != 1:
        raise ValueError(f"grouped_gemm: group_sizes must be 1-D [groups], got shape {tuple(group_sizes.shape)}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"grouped_gemm: group_sizes must be int32 or int64 (rows per group), got {group_sizes.dtype}; "
            "convert with group_sizes.to(torch.int32)"
        )
    num_groups, in_features, _ = w.shape
    if num_groups == 0:
        raise ValueError("grouped_gemm: w has 0 groups; there must be at least one group")
    if group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"grouped_gemm: group_sizes has {group_sizes.shape[0]} entries but w has {num_groups} groups "
            f"(w.shape = {tuple(w.shape)}); pass one size per group"
        )
    if x.shape[1] != in_features:
        raise ValueError(
            f"grouped_gemm: x has {x.shape[1]} features but w expects {in_features} "
            f"(x.shape = {tuple(x.shape)}, w.shape = {tuple(w.shape)}); w must be [groups, in, out]"
        )
    if x.dtype != w.dtype:
        raise TypeError(f"grouped_gemm: x is {x.dtype} but w is {w.dtype}; cast both to the same dtype")
    if x.dtype not in _REFERENCE_DTYPES:
        raise TypeError(f"grouped_gemm: dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    if x.device != w.device or group_sizes.device != x.device:
        raise ValueError(
            f"grouped_gemm: x ({x.device}), w ({w.device}) and group_sizes ({group_sizes.device}) must be "
            "on the same device (keep group_sizes on the GPU: the kernels read it there without a sync)"
        )


def _resolve_backend(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend("grouped_gemm", [x], _AVAILABLE, backend)
    if backend is None and x.dtype not in _TRITON_DTYPES:
        return REFERENCE  # float64 (tests) only has the reference
    if chosen == TRITON:
        if x.dtype not in _TRITON_DTYPES:
            raise TypeError(f"grouped_gemm: the Triton backend supports bf16/fp16/fp32, got {x.dtype}")
        if not x.is_cuda and not triton_interpreting():
            raise RuntimeError(
                "grouped_gemm: backend='triton' on CPU tensors needs the Triton interpreter; set "
                "TRITON_INTERPRET=1 before triton is imported, or use backend='reference'"
            )
    return chosen


def _apply_autocast(x, w):
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return x, w  # _check_inputs names the bad argument
    device_type = x.device.type
    if not (x.is_floating_point() and w.is_floating_point() and torch.is_autocast_enabled(device_type)):
        return x, w
    dtype = torch.get_autocast_dtype(device_type)
    return x.to(dtype), w.to(dtype)


# The op is a torch.library custom op with a fake implementation and a registered backward, so
# torch.compile traces an MoE block through it; the backend is resolved inside (it reads the
# environment), where the group sizes can also be checked on the host.


SELECTIVE_CHECKPOINT_SAVES.join("xorl::grouped_gemm")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::grouped_gemm", mutates_args=())
def _grouped_gemm_op(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, backend: str | None) -> torch.Tensor:
    if _resolve_backend(backend, x) == REFERENCE:
        return grouped_gemm_reference(x, w, group_sizes)
    from xorl_kernels.expert_gemm.triton_kernels import grouped_gemm_forward

    if group_sizes.device.type == "cpu" or env_flag("XORL_CHECK_GROUP_SIZES"):
        check_group_sizes_values(group_sizes, x.shape[0])
    return grouped_gemm_forward(x, w, group_sizes)


@_grouped_gemm_op.register_fake
def _(x, w, group_sizes, backend):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("xorl::grouped_gemm_backward", mutates_args=())
def _grouped_gemm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, backend: str | None,
    need_dx: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw); an input whose gradient is not needed gets an empty tensor."""
    dy = dy.contiguous()
    dx, dw = x.new_empty(0), w.new_empty(0)
    if _resolve_backend(backend, x) == REFERENCE:
        if need_dx:
            dx = grouped_gemm_reference(dy, w.transpose(1, 2), group_sizes)
        if need_dw:
            dw = grouped_gemm_weight_grad_reference(x, dy, group_sizes, w.dtype)
        return dx, dw
    from xorl_kernels.expert_gemm.triton_kernels import grouped_gemm_forward, grouped_gemm_weight_grad

    if need_dx:
        # dx_g = dy_g @ w[g]^T: the forward kernel on a transposed (strided, uncopied) view of w.
        dx = grouped_gemm_forward(dy, w.transpose(1, 2), group_sizes)
    if need_dw:
        dw = grouped_gemm_weight_grad(x, dy, group_sizes, out_dtype=w.dtype)
    return dx, dw


@_grouped_gemm_backward_op.register_fake
def _(dy, x, w, group_sizes, backend, need_dx, need_dw):
    return x.new_empty(x.shape if need_dx else (0,)), w.new_empty(w.shape if need_dw else (0,))


def _setup_context(ctx, inputs, output):
    x, w, group_sizes, backend = inputs
    ctx.save_for_backward(x, w, group_sizes)
    ctx.backend = backend


def _backward(ctx, dy):
    x, w, group_sizes = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.xorl.grouped_gemm_backward(dy, x, w, group_sizes, ctx.backend, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


_grouped_gemm_op.register_autograd(_backward, setup_context=_setup_context)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::grouped_gemm_bias")


@torch.library.custom_op("xorl::grouped_gemm_bias", mutates_args=())
def _grouped_gemm_bias_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, group_sizes: torch.Tensor,
                          backend: str | None) -> torch.Tensor:
    if _resolve_backend(backend, x) == REFERENCE:
        return grouped_gemm_reference(x, w, group_sizes, bias)
    from xorl_kernels.expert_gemm.triton_kernels import grouped_gemm_forward

    if group_sizes.device.type == "cpu" or env_flag("XORL_CHECK_GROUP_SIZES"):
        check_group_sizes_values(group_sizes, x.shape[0])
    return grouped_gemm_forward(x, w, group_sizes, bias=bias)


@_grouped_gemm_bias_op.register_fake
def _(x, w, bias, group_sizes, backend):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("xorl::grouped_bias_grad", mutates_args=())
def _grouped_bias_grad_op(dy: torch.Tensor, bias: torch.Tensor, group_sizes: torch.Tensor,
                          backend: str | None) -> torch.Tensor:
    """db [G, N] in bias's dtype: the sum of dy's rows of each group."""
    if _resolve_backend(backend, dy) == REFERENCE:
        return grouped_bias_grad_reference(dy, group_sizes, bias.dtype)
    from xorl_kernels.expert_gemm.triton_kernels import grouped_bias_grad

    return grouped_bias_grad(dy.contiguous(), group_sizes, bias.dtype)


@_grouped_bias_grad_op.register_fake
def _(dy, bias, group_sizes, backend):
    return bias.new_empty(bias.shape)


def _bias_setup_context(ctx, inputs, output):
    x, w, bias, group_sizes, backend = inputs
    ctx.save_for_backward(x, w, bias, group_sizes)
    ctx.backend = backend


def _bias_backward(ctx, dy):
    x, w, bias, group_sizes = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx = dw = db = None
    if need_dx or need_dw:
        dx, dw = torch.ops.xorl.grouped_gemm_backward(dy, x, w, group_sizes, ctx.backend, need_dx, need_dw)
    if need_db:
        db = torch.ops.xorl.grouped_bias_grad(dy, bias, group_sizes, ctx.backend)
    return (dx if need_dx else None), (dw if need_dw else None), db, None, None


_grouped_gemm_bias_op.register_autograd(_bias_backward, setup_context=_bias_setup_context)


def grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, bias: torch.Tensor | None = None, *,
    backend: str | None = None
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g] (+ bias[g])`` for x [M, K] sorted by group, w [G, K, N],
    bias [G, N] or None -> y [M, N].

    ``group_sizes`` [G] (int32/int64, same device as x) gives the rows per group and must sum to
    M. ``backend``: None (pick: CUDA -> Triton, CPU -> reference), "triton" or "reference".
    Under autocast, x and w (and bias) are cast to the autocast dtype first, as ``F.linear`` would be.
    """
    x, w = _apply_autocast(x, w)
    _check_inputs(x, w, group_sizes)
    if backend is not None:
        _resolve_backend(backend, x)  # a wrong name is an error here, before any tracing
    if bias is None:
        return torch.ops.xorl.grouped_gemm(x, w, group_sizes, backend)
    bias = bias.to(x.dtype) if torch.is_autocast_enabled(x.device.type) else bias
    if bias.shape != (w.shape[0], w.shape[2]) or bias.dtype != x.dtype or bias.device != x.device:
        raise ValueError(f"grouped_gemm: bias must be [groups, out_features] = {[w.shape[0], w.shape[2]]} in x's "
                         f"dtype and device, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")
    return torch.ops.xorl.grouped_gemm_bias(x, w, bias, group_sizes, backend)
