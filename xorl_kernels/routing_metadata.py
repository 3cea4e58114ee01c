"""MoE routing metadata: the expert-sorted order of the (token, k) slots, and the row moves it drives.

Definitions, for ``expert_ids`` [T, K] (int32 or int64) and E = ``num_experts``. Slot s = t*K + k
is the k-th expert choice of token t. An id outside [0, E) marks a dropped slot: negative ids are
the convention for that (e.g. -1 for a token over capacity); ids >= E are an error (a ValueError for
CPU ids, a device-side assert for GPU ids) but are still handled as dropped so no kernel ever
addresses memory out of range.

- ``tokens_per_expert`` [E] int64: how many slots chose expert e (a histogram; dropped slots not counted).
- ``expert_offsets`` [E + 1] int64: exclusive cumsum of tokens_per_expert; expert e's rows are
  ``[expert_offsets[e], expert_offsets[e+1])``; ``expert_offsets[E]`` = number of kept slots
  (= T*K when nothing is dropped).
- ``row_map`` [T, K] int64: the row of slot (t, k) in expert-sorted order. The order is stable:
  rows go expert 0 first, and inside an expert by increasing slot index t*K + k. Dropped slots
  take the rows ``[expert_offsets[E], T*K)``, also in slot order. row_map is a permutation of
  0 .. T*K-1.
- ``sorted_slots`` [T*K] int64: the inverse of row_map: ``sorted_slots[row_map[t, k]] == t*K + k``.
- ``sorted_tokens`` [T*K] int64: ``sorted_slots // K``, the source token of every sorted row (what
  ``permute_rows`` gathers with).

``routing_metadata(expert_ids, E) -> (sorted_slots, row_map, tokens_per_expert)`` (what
permute.py unpacks); ``routing_metadata_full(...) -> RoutingMetadata`` adds expert_offsets and
sorted_tokens. On CUDA with the extension built, one csrc counting sort (3 launches, no host
synchronisation, int64 addressing, deterministic); otherwise the plain-torch reference (a stable
sort and a bincount), which never reads a device value on the host either.

The row moves, with references here and csrc kernels in _ext.py (the autograd op is permute.py):
- ``permute_rows(x [T, H], src_row [R]) -> [R, H]``: ``out[r] = x[src_row[r]]`` (a zero row for an
  index outside [0, T)); with src_row = sorted_tokens this is the MoE permute.
- ``unpermute_combine(y [R, H], row_of_slot [T, K], weights [T, K]) -> [T, H]``:
  ``out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]]`` accumulated in fp32 in k order (no
  atomics), in y's dtype; a row index outside [0, R) contributes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from xorl_kernels._ext import ext_permute_rows, ext_routing_metadata, ext_unpermute_combine, use_cuda_ext


class RoutingMetadata(NamedTuple):
    sorted_slots: torch.Tensor  # [T*K] int64
    row_map: torch.Tensor  # [T, K] int64
    tokens_per_expert: torch.Tensor  # [E] int64
    expert_offsets: torch.Tensor  # [E + 1] int64
    sorted_tokens: torch.Tensor  # [T*K] int64


def _check_routing_args(expert_ids: torch.Tensor, num_experts: int) -> None:
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [tokens, top_k], got shape {tuple(expert_ids.shape)}")
    if expert_ids.shape[1] < 1:
        raise ValueError(f"expert_ids must have top_k >= 1 columns, got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_ids must be int32 or int64, got {expert_ids.dtype}; convert with .long()")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if expert_ids.numel() == 0:
        return
    if expert_ids.is_cuda:
        torch._assert_async(
            (expert_ids < num_experts).all(),
            f"routing_metadata: expert_ids must be < num_experts={num_experts}",
        )
    elif int(expert_ids.max()) >= num_experts:
        raise ValueError(
            f"expert_ids must be < num_experts={num_experts} (negative ids mark dropped slots), found "
            f"{int(expert_ids.max())}"
        )


def routing_metadata_reference(expert_ids: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """Plain torch: a stable sort of the flattened ids (dropped slots as bucket E) and a bincount."""
    _check_routing_args(expert_ids, num_experts)
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    sorted_slots = torch.sort(bucket, stable=True).indices
    row_map = torch.empty_like(sorted_slots)
    row_map[sorted_slots] = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    counts = torch.bincount(bucket, minlength=num_experts + 1)
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    expert_offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    return RoutingMetadata(
        sorted_slots,
        row_map.view(expert_ids.shape),
        counts[:num_experts].clone(),
        expert_offsets,
        torch.div(sorted_slots, top_k, rounding_mode="floor"),
    )


def routing_metadata_full(expert_ids: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """All five outputs (see the module docstring); csrc on CUDA, else the reference."""
    if use_cuda_ext(expert_ids):
        _check_routing_args(expert_ids, num_experts)
        return RoutingMetadata(*ext_routing_metadata(expert_ids.contiguous(), num_experts))
    return routing_metadata_reference(expert_ids, num_experts)


def routing_metadata(expert_ids: torch.Tensor, num_experts: int):
    """(sorted_slots [T*K], row_map [T, K], tokens_per_expert [E]), all int64; see the module docstring."""
    meta = routing_metadata_full(expert_ids, num_experts)
    return meta.sorted_slots, meta.row_map, meta.tokens_per_expert


# ---------------------------------------------------------------------------------------------
# The row moves
# ---------------------------------------------------------------------------------------------


def permute_rows_reference(x: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
    """out[r] = x[src_row[r]]; an index outside [0, T) gives a zero row."""
    valid = (src_row >= 0) & (src_row < x.shape[0])
    out = x.index_select(0, torch.where(valid, src_row, torch.zeros_like(src_row)))
    return out.masked_fill_(~valid.unsqueeze(1), 0)


def unpermute_combine_reference(
    y: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]] in fp32 in k order, cast to y's dtype."""
    valid = (row_of_slot >= 0) & (row_of_slot < y.shape[0])
    safe = torch.where(valid, row_of_slot, torch.zeros_like(row_of_slot))
    w = torch.where(valid, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    out = torch.zeros(row_of_slot.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(row_of_slot.shape[1]):
        out += w[:, k : k + 1] * y.index_select(0, safe[:, k]).float()
    return out.to(y.dtype)


def permute_rows(x: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
    """Row gather (csrc on CUDA); not differentiable by itself (permute.py holds the autograd op)."""
    if use_cuda_ext(x, src_row):
        return ext_permute_rows(x.contiguous(), src_row.contiguous().long())
    return permute_rows_reference(x, src_row.long())


def unpermute_combine(y: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of every token's K rows (csrc on CUDA); not differentiable by itself."""
    if use_cuda_ext(y, row_of_slot, weights) and y.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return ext_unpermute_combine(
            y.contiguous(), row_of_slot.contiguous().long(), weights.contiguous().float()
        )
    return unpermute_combine_reference(y, row_of_slot.long(), weights)
