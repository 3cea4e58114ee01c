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

Dispatch: csrc kernels (CUDA tensors, extension built: routing metadata, row gather, weighted
combine) -> Triton (CUDA tensors; always for the unpermute backward, which fuses the weight
gradient) -> torch (CPU, or XORL_FORCE_REFERENCE=1). No path reads a device value on the host: expert ids are range-checked
only for CPU tensors (a check on GPU would sync), so out-of-range ids on GPU are undefined.
All row addressing is int64 (T*K*H may exceed 2^31).
"""

from __future__ import annotations

import os

import torch

# ---------------------------------------------------------------------------------------------
# Routing metadata: the expert-sorted order of the T*K slots and its inverse
# ---------------------------------------------------------------------------------------------


def _invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv[perm[i]] = i. Every destination is written once, so the scatter is deterministic and,
    unlike boolean or accumulate indexing, never syncs with the host."""
    inv = new_empty(perm.shape, perm.dtype, perm.device)
    return inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def routing_metadata_reference(expert_ids: torch.Tensor, num_experts: int):
    """Return (sorted_slots [T*K], row_map [T, K], tokens_per_expert [E]), all int64, torch only.

    ``sorted_slots[r]`` is the slot (t*K + k) whose row lands at position r of x_sorted;
    ``row_map`` is its inverse. The sort is stable so ties keep slot order.
    """
    flat = expert_ids.reshape(-1).long()
    sorted_slots = torch.sort(flat, stable=True).indices
    row_map = _invert_permutation(sorted_slots)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return sorted_slots, row_map.view(expert_ids.shape), counts


def _routing_metadata(expert_ids: torch.Tensor, num_experts: int):
    """(sorted_slots, row_map, tokens_per_expert): the csrc counting sort on CUDA, else torch."""
    if _backend(expert_ids) == "csrc":
        from xorl_kernels import _ext, routing_metadata

        if num_experts <= _ext._C.routing_max_experts():
            return routing_metadata.routing_metadata(expert_ids, num_experts)
    return routing_metadata_reference(expert_ids, num_experts)


# ---------------------------------------------------------------------------------------------
# Plain-torch reference of the three data movements (also the CPU path)
# ---------------------------------------------------------------------------------------------


def new_empty(shape, dtype, device) -> torch.Tensor:
    """Allocation of every output this op writes; tests swap it for a NaN-filled one (poisoning)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    # fp32 accumulation for every training dtype; float64 stays float64 (test references).
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[r] = src[index[r]]."""
    return src.index_select(0, index)


def combine_reference(y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None):
    """y[t] = sum_k w[t, k] * y_sorted[row_map[t, k]] in fp32, in k order, cast to y_sorted.dtype."""
    acc = _acc_dtype(y_sorted)
    rows = y_sorted.index_select(0, row_map.reshape(-1)).view(*row_map.shape, y_sorted.shape[1]).to(acc)
    if weights is not None:
        rows = rows * weights.to(acc).unsqueeze(-1)
    out = rows[:, 0]
    for k in range(1, row_map.shape[1]):  # explicit k order: the same sum on every backend
        out = out + rows[:, k]
    return out.to(y_sorted.dtype)


def scatter_weighted_reference(grad_y, row_map, weights, y_sorted, need_weight_grad: bool):
    """Backward of combine: (grad_y_sorted, grad_weights or None)."""
    num_tokens, top_k = row_map.shape
    acc = _acc_dtype(y_sorted)
    g = grad_y.to(acc).unsqueeze(1).expand(num_tokens, top_k, grad_y.shape[-1])
    scaled = g * weights.to(acc).unsqueeze(-1) if weights is not None else g
    grad_sorted = new_empty((row_map.numel(), grad_y.shape[-1]), y_sorted.dtype, grad_y.device)
    grad_sorted.index_copy_(0, row_map.reshape(-1), scaled.reshape(-1, grad_y.shape[-1]).to(y_sorted.dtype))
    grad_w = None
    if need_weight_grad:
        rows = y_sorted.index_select(0, row_map.reshape(-1)).view(num_tokens, top_k, y_sorted.shape[1]).to(acc)
        grad_w = (rows * g).sum(-1)
    return grad_sorted, grad_w


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


_BACKENDS = ("csrc", "triton", "torch")


def _backend(t: torch.Tensor) -> str:
    """csrc (CUDA tensor, extension built) -> triton (CUDA tensor) -> torch. XORL_FORCE_REFERENCE=1
    forces torch; XORL_PERMUTE_BACKEND=triton|csrc|torch picks one for CUDA tensors (benchmarks)."""
    if not t.is_cuda or os.environ.get("XORL_FORCE_REFERENCE", "0") not in ("", "0"):
        return "torch"
    forced = os.environ.get("XORL_PERMUTE_BACKEND", "")
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"XORL_PERMUTE_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        return forced
    from xorl_kernels._ext import has_cuda_ext

    return "csrc" if has_cuda_ext() else "triton"


def _gather_rows(src, index):
    backend = _backend(src)
    if backend == "csrc":
        from xorl_kernels._ext import ext_permute_rows

        return ext_permute_rows(src, index, out=new_empty((index.numel(), src.shape[1]), src.dtype, src.device))
    if backend == "triton":
        from xorl_kernels import permute_triton

        return permute_triton.gather_rows(src, index)
    return gather_rows_reference(src, index)


def _combine(y_sorted, row_map, weights):
    backend = _backend(y_sorted)
    if backend == "csrc" and y_sorted.dtype in (torch.float32, torch.float16, torch.bfloat16):
        from xorl_kernels._ext import ext_unpermute_combine

        w = torch.ones(row_map.shape, device=y_sorted.device) if weights is None else weights.float()
        out = new_empty((row_map.shape[0], y_sorted.shape[1]), y_sorted.dtype, y_sorted.device)
        return ext_unpermute_combine(y_sorted, row_map, w.contiguous(), out=out)
    if backend in ("csrc", "triton"):
        from xorl_kernels import permute_triton

        return permute_triton.combine(y_sorted, row_map, weights)
    return combine_reference(y_sorted, row_map, weights)


def _scatter_weighted(grad_y, row_map, sorted_slots, weights, y_sorted, need_weight_grad):
    # No csrc kernel for this one (a weighted gather fused with the weight-gradient dot): Triton.
    if _backend(grad_y) in ("csrc", "triton"):
        from xorl_kernels import permute_triton

        return permute_triton.scatter_weighted(grad_y, sorted_slots, weights, y_sorted, need_weight_grad)
    return scatter_weighted_reference(grad_y, row_map, weights, y_sorted, need_weight_grad)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sorted_slots, row_map):
        ctx.save_for_backward(row_map)
        top_k = row_map.shape[1]
        return _gather_rows(x, torch.div(sorted_slots, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_sorted):
        (row_map,) = ctx.saved_tensors
        return _combine(grad_sorted.contiguous(), row_map, None), None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, row_map, sorted_slots, weights):
        ctx.save_for_backward(y_sorted, row_map, sorted_slots, weights)
        ctx.weights_dtype = None if weights is None else weights.dtype
        return _combine(y_sorted, row_map, weights)

    @staticmethod
    def backward(ctx, grad_y):
        y_sorted, row_map, sorted_slots, weights = ctx.saved_tensors
        need_w = weights is not None and ctx.needs_input_grad[3]
        grad_sorted, grad_w = _scatter_weighted(grad_y.contiguous(), row_map, sorted_slots, weights, y_sorted, need_w)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weights_dtype)
        return grad_sorted, None, None, grad_w


def _inverse_row_map(row_map: torch.Tensor) -> torch.Tensor:
    return _invert_permutation(row_map.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------


def permute_tokens(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """Group the T*K (token, k) rows of ``x`` by expert. See the module docstring."""
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
    if not expert_ids.is_cuda and expert_ids.numel() > 0:
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must lie in [0, num_experts={num_experts}), found values in [{lo}, {hi}]")
    sorted_slots, row_map, tokens_per_expert = _routing_metadata(expert_ids, num_experts)
    x_sorted = _PermuteFn.apply(x.contiguous(), sorted_slots, row_map)
    return x_sorted, row_map, tokens_per_expert


def unpermute_tokens(y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None):
    """Gather the K expert outputs of every token back and sum them with ``weights`` (fp32)."""
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
    sorted_slots = _inverse_row_map(row_map)
    return _UnpermuteFn.apply(y_sorted.contiguous(), row_map.contiguous(), sorted_slots, weights)
