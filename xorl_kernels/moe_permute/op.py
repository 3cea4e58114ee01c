"""Token permute / unpermute for mixture-of-experts: the op, its kernels and its plain-torch reference.

``permute_tokens(x, expert_ids, num_experts) -> (x_sorted, row_map, tokens_per_expert)``
    x [T, H], expert_ids [T, K] (integer, each in [0, num_experts)). Every (token, k) slot gets
    one row of ``x_sorted`` [T*K, H]; rows are grouped by expert (expert 0 first) and, inside an
    expert, ordered by slot index t*K + k (a stable sort, so the layout is deterministic).
    ``row_map`` [T, K] int64: ``x_sorted[row_map[t, k]] == x[t]``. ``tokens_per_expert`` [E] int64.

``unpermute_tokens(y_sorted, row_map, weights=None) -> y``
    ``y[t] = sum_k weights[t, k] * y_sorted[row_map[t, k]]``, accumulated in fp32 in k order (no
    atomics, bitwise deterministic), returned in ``y_sorted.dtype``. ``weights=None`` means 1.

Both are differentiable; the backward of one is the other: grad_x = unpermute(grad_x_sorted,
row_map, 1); grad_y_sorted[row_map[t, k]] = weights[t, k] * grad_y[t]; and the weights get
grad_w[t, k] = <grad_y[t], y_sorted[row_map[t, k]]> (fp32 dot).

Dispatch (xorl_kernels.dispatch, once per call; ``backend=`` picks one by name): csrc kernels
(CUDA tensors, extension built: routing metadata, row gather, weighted combine) -> Triton (CUDA
tensors; always for the unpermute backward, which fuses the weight gradient, and for dtypes the
csrc combine lacks) -> the plain-torch reference (CPU, or XORL_FORCE_REFERENCE=1; reference.py).
No path reads a device value on the host: expert ids are range-checked only for CPU tensors (a
check on GPU would sync), so out-of-range ids on GPU are undefined. All row addressing is int64 (T*K*H may exceed 2^31).
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import CSRC, REFERENCE, TRITON, pick_backend
from xorl_kernels.moe_permute.csrc import ext_permute_rows, ext_unpermute_combine
from xorl_kernels.moe_permute.reference import (
    permute_rows_reference,
    scatter_weighted_reference,
    unpermute_combine_reference,
)
from xorl_kernels.moe_permute.routing import routing_metadata

_CSRC_COMBINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def new_empty(shape, dtype, device) -> torch.Tensor:
    """Allocation of every output the kernels write; tests swap it for a NaN-filled one (poisoning)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _backend(t: torch.Tensor, requested: str | None) -> str:
    return pick_backend("permute_tokens", [t], (CSRC, TRITON, REFERENCE), requested)


def _invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv[perm[i]] = i. Every destination is written once, so the scatter is deterministic and,
    unlike boolean or accumulate indexing, never syncs with the host."""
    inv = torch.empty_like(perm)
    return inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


# ---------------------------------------------------------------------------------------------
# The three row moves, on the backend picked for the call
# ---------------------------------------------------------------------------------------------


def _gather_rows(src, index, backend):
    if backend == REFERENCE:
        return permute_rows_reference(src, index)
    out = new_empty((index.numel(), src.shape[1]), src.dtype, src.device)
    if backend == CSRC:
        return ext_permute_rows(src, index, out=out)
    from xorl_kernels.moe_permute import triton_kernels

    return triton_kernels.gather_rows(src, index, out)


def _combine(y_sorted, row_map, weights, backend):
    if backend == REFERENCE:
        return unpermute_combine_reference(y_sorted, row_map, weights)
    out = new_empty((row_map.shape[0], y_sorted.shape[1]), y_sorted.dtype, y_sorted.device)
    if backend == CSRC and y_sorted.dtype in _CSRC_COMBINE_DTYPES:
        w = torch.ones(row_map.shape, device=y_sorted.device) if weights is None else weights.float()
        return ext_unpermute_combine(y_sorted, row_map, w.contiguous(), out=out)
    from xorl_kernels.moe_permute import triton_kernels

    return triton_kernels.combine(y_sorted, row_map, weights, out)


def _scatter_weighted(grad_y, row_map, sorted_slots, weights, y_sorted, need_weight_grad, backend):
    grad_sorted = new_empty((row_map.numel(), grad_y.shape[-1]), y_sorted.dtype, grad_y.device)
    if backend == REFERENCE:
        return scatter_weighted_reference(grad_y, row_map, weights, y_sorted, need_weight_grad, out=grad_sorted)
    # No csrc kernel for this one (a weighted gather fused with the weight-gradient dot): Triton.
    from xorl_kernels.moe_permute import triton_kernels

    grad_w = new_empty((row_map.numel(),), torch.float32, grad_y.device) if need_weight_grad else None
    return triton_kernels.scatter_weighted(grad_y, sorted_slots, weights, y_sorted, grad_sorted, grad_w)


# ---------------------------------------------------------------------------------------------
# The custom ops: xorl::permute_tokens, xorl::unpermute_tokens (+ its backward)
# ---------------------------------------------------------------------------------------------
# torch.library custom ops with fake implementations and registered backwards, so torch.compile
# traces an MoE block through them. The backend is picked and the CPU ids are range-checked (a
# host read) inside, where the tensors are real.


@torch.library.custom_op("xorl::permute_tokens", mutates_args=())
def _permute_op(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, backend: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not expert_ids.is_cuda and expert_ids.numel() > 0:
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must lie in [0, num_experts={num_experts}), found values in [{lo}, {hi}]")
    chosen = _backend(x, backend)
    # The routing sort has a csrc kernel and a (sync-free) torch reference, no Triton one.
    meta = routing_metadata(expert_ids, num_experts, CSRC if chosen == CSRC else REFERENCE)
    return _gather_rows(x, meta.sorted_tokens, chosen), meta.row_map, meta.tokens_per_expert


@_permute_op.register_fake
def _(x, expert_ids, num_experts, backend):
    tokens, top_k = expert_ids.shape
    int64 = dict(dtype=torch.int64)
    return x.new_empty((tokens * top_k, x.shape[1])), x.new_empty((tokens, top_k), **int64), x.new_empty(
        (num_experts,), **int64
    )


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.backend = inputs[3]


def _permute_backward(ctx, grad_sorted, _grad_row_map, _grad_counts):
    (row_map,) = ctx.saved_tensors
    return torch.ops.xorl.unpermute_tokens(grad_sorted.contiguous(), row_map, None, ctx.backend), None, None, None


@torch.library.custom_op("xorl::unpermute_tokens", mutates_args=())
def _unpermute_op(
    y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None, backend: str | None
) -> torch.Tensor:
    return _combine(y_sorted, row_map, weights, _backend(y_sorted, backend))


@_unpermute_op.register_fake
def _(y_sorted, row_map, weights, backend):
    return y_sorted.new_empty((row_map.shape[0], y_sorted.shape[1]))


@torch.library.custom_op("xorl::unpermute_tokens_backward", mutates_args=())
def _unpermute_backward_op(
    grad_y: torch.Tensor, y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None,
    need_weight_grad: bool, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_y_sorted, grad_weights in weights' dtype; an empty tensor when not needed)."""
    sorted_slots = _invert_permutation(row_map.reshape(-1))
    grad_sorted, grad_w = _scatter_weighted(
        grad_y.contiguous(), row_map, sorted_slots, weights, y_sorted, need_weight_grad, _backend(grad_y, backend)
    )
    if grad_w is None:
        return grad_sorted, grad_y.new_empty(0)
    return grad_sorted, grad_w.reshape(row_map.shape).to(weights.dtype)


@_unpermute_backward_op.register_fake
def _(grad_y, y_sorted, row_map, weights, need_weight_grad, backend):
    grad_w = weights.new_empty(weights.shape) if need_weight_grad else grad_y.new_empty(0)
    return y_sorted.new_empty(y_sorted.shape), grad_w


def _unpermute_setup(ctx, inputs, output):
    y_sorted, row_map, weights, backend = inputs
    ctx.save_for_backward(y_sorted, row_map, weights)
    ctx.backend = backend


def _unpermute_backward(ctx, grad_y):
    y_sorted, row_map, weights = ctx.saved_tensors
    need_w = weights is not None and ctx.needs_input_grad[2]
    grad_sorted, grad_w = torch.ops.xorl.unpermute_tokens_backward(
        grad_y, y_sorted, row_map, weights, need_w, ctx.backend
    )
    return grad_sorted, None, (grad_w if need_w else None), None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# ---------------------------------------------------------------------------------------------
# Public ops: argument checks that need no host read, then the custom ops
# ---------------------------------------------------------------------------------------------


def permute_tokens(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, backend: str | None = None):
    """Group the T*K (token, k) rows of ``x`` by expert. See the module docstring.

    ``backend``: "csrc", "triton", "reference" or None (pick: xorl_kernels.dispatch)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}; reshape(-1, hidden) first")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be [tokens, top_k] with tokens={x.shape[0]}, got {tuple(expert_ids.shape)}")
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if expert_ids.device != x.device:
        raise ValueError(f"x is on {x.device} but expert_ids on {expert_ids.device}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if backend is not None:
        _backend(x, backend)  # a wrong name is an error here, before any tracing
    if expert_ids.dtype not in (torch.int32, torch.int64):
        expert_ids = expert_ids.long()  # the routing sort takes int32 / int64 ids
    # (expert ids are range-checked inside the op: on CPU tensors only, a check on GPU would sync)
    return torch.ops.xorl.permute_tokens(x.contiguous(), expert_ids, int(num_experts), backend)


def unpermute_tokens(
    y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None, *, backend: str | None = None
):
    """Gather the K expert outputs of every token back and sum them with ``weights`` (fp32).

    ``backend``: as for permute_tokens."""
    if y_sorted.dim() != 2:
        raise ValueError(f"y_sorted must be [tokens*top_k, hidden], got shape {tuple(y_sorted.shape)}")
    if row_map.dim() != 2 or row_map.dtype != torch.int64:
        raise ValueError(
            f"row_map must be the int64 [tokens, top_k] map from permute_tokens, got "
            f"{row_map.dtype} {tuple(row_map.shape)}"
        )
    if y_sorted.shape[0] != row_map.numel():
        raise ValueError(
            f"y_sorted has {y_sorted.shape[0]} rows but row_map addresses {row_map.numel()} "
            f"(tokens*top_k = {tuple(row_map.shape)}); pass the row_map returned with these rows"
        )
    if not y_sorted.dtype.is_floating_point:
        raise TypeError(f"y_sorted must be a floating-point tensor, got {y_sorted.dtype}")
    if weights is not None:
        if weights.shape != row_map.shape:
            raise ValueError(f"weights must have row_map's shape {tuple(row_map.shape)}, got {tuple(weights.shape)}")
        if not weights.dtype.is_floating_point:
            raise TypeError(f"weights must be floating point, got {weights.dtype}")
        weights = weights.contiguous()
    if backend is not None:
        _backend(y_sorted, backend)
    return torch.ops.xorl.unpermute_tokens(y_sorted.contiguous(), row_map.contiguous(), weights, backend)
