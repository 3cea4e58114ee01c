"""MoE routing metadata: the expert-sorted order of the (token, k) slots.

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

``routing_metadata(expert_ids, E) -> RoutingMetadata`` (the five tensors above). On CUDA with the
extension built, one csrc counting sort (3 launches, no host synchronisation, int64 addressing,
deterministic); otherwise ``routing_metadata_reference`` (a stable sort and a bincount), which
never reads a device value on the host either. permute_tokens (moe_permute/op.py) uses it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from xorl_kernels.dispatch import CSRC, REFERENCE, pick_backend
from xorl_kernels.moe_permute.csrc import ext_routing_metadata, routing_max_experts


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
    """Plain torch: a stable sort of the flattened ids (dropped slots as bucket E) and a histogram.

    Scatters instead of bincount and index assignment, so it never syncs with the host on a GPU
    either (bincount reads the maximum back to size its output).
    """
    _check_routing_args(expert_ids, num_experts)
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    sorted_slots = torch.sort(bucket, stable=True).indices
    row_map = torch.empty_like(sorted_slots).scatter_(
        0, sorted_slots, torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    )
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    expert_offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    return RoutingMetadata(
        sorted_slots,
        row_map.view(expert_ids.shape),
        counts[:num_experts].clone(),
        expert_offsets,
        torch.div(sorted_slots, top_k, rounding_mode="floor"),
    )


def routing_metadata(expert_ids: torch.Tensor, num_experts: int, backend: str | None = None) -> RoutingMetadata:
    """All five outputs (see the module docstring): csrc on CUDA, else the reference (``backend``:
    "csrc", "reference" or None to pick)."""
    backend = pick_backend("routing_metadata", [expert_ids], (CSRC, REFERENCE), backend)
    if backend == CSRC and num_experts <= routing_max_experts():
        _check_routing_args(expert_ids, num_experts)
        return RoutingMetadata(*ext_routing_metadata(expert_ids.contiguous(), num_experts))
    return routing_metadata_reference(expert_ids, num_experts)
