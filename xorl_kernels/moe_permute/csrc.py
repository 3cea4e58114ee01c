"""Checked wrappers around the extension's MoE routing-metadata and row-movement kernels.

Its one job: validate inputs, allocate outputs and launch ``_C.routing_metadata`` (sort slots by
expert with no host sync), ``_C.permute_rows`` (gather token rows into expert order) and
``_C.unpermute_combine`` (weighted top-k combine back to token order), using the shared checks and
``launch`` of ``xorl_kernels.cuda_ext``. The definitions are in routing.py, the references in reference.py.
"""

from __future__ import annotations

import torch

from xorl_kernels.cuda_ext import COMBINE_DTYPES, ID_DTYPES, check, check_out, launch, require_ext


def routing_max_experts() -> int:
    """The most experts the csrc counting sort handles (more fall back to the reference)."""
    return require_ext("routing_metadata").routing_max_experts()


def ext_routing_metadata(expert_ids: torch.Tensor, num_experts: int):
    """(sorted_slots [T*K], row_map [T, K], tokens_per_expert [E], expert_offsets [E+1], sorted_tokens [T*K]).

    All int64, computed on the device with no host synchronisation. Ids outside [0, num_experts)
    are dropped slots: they sort after every expert and are not counted.
    """
    op = "routing_metadata"
    ext = require_ext(op)
    check(expert_ids, "expert_ids", op, dtypes=ID_DTYPES, dim=2)
    if not 1 <= num_experts <= ext.routing_max_experts():
        raise ValueError(f"{op}: num_experts must be in [1, {ext.routing_max_experts()}], got {num_experts}")
    tokens, top_k = expert_ids.shape
    if top_k < 1:
        raise ValueError(
            f"{op}: expert_ids must have top_k >= 1 columns, got shape {tuple(expert_ids.shape)}"
        )
    num_slots = tokens * top_k
    dev = expert_ids.device
    workspace = torch.empty(
        ext.routing_workspace_elems(num_slots, num_experts), dtype=torch.int64, device=dev
    )
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=dev)
    expert_offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    row_map = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    sorted_slots = torch.empty(num_slots, dtype=torch.int64, device=dev)
    sorted_tokens = torch.empty(num_slots, dtype=torch.int64, device=dev)
    launch(
        dev,
        "routing_metadata",
        False,
        expert_ids.data_ptr(),
        expert_ids.dtype == torch.int64,
        num_slots,
        top_k,
        num_experts,
        workspace.data_ptr(),
        tokens_per_expert.data_ptr(),
        expert_offsets.data_ptr(),
        row_map.data_ptr(),
        sorted_slots.data_ptr(),
        sorted_tokens.data_ptr(),
    )
    return sorted_slots, row_map, tokens_per_expert, expert_offsets, sorted_tokens


def ext_permute_rows(
    x: torch.Tensor,
    src_row: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """out[r] = x[src_row[r]] for x [T, H] (any dtype), src_row [R] int64; an index outside [0, T) gives a zero row."""
    op = "permute_rows"
    require_ext(op)
    host = host_emulation
    check(x, "x", op, dim=2, host=host)
    check(src_row, "src_row", op, device=x.device, dtypes=[torch.int64], dim=1, host=host)
    shape = (src_row.shape[0], x.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        check_out(out, shape, x.dtype, x.device, op, host=host)
    row_bytes = x.shape[1] * x.element_size()
    launch(
        x.device,
        "permute_rows",
        host,
        x.data_ptr(),
        src_row.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        shape[0],
        row_bytes,
    )
    return out


def ext_unpermute_combine(
    y: torch.Tensor,
    row_of_slot: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]] (fp32, k order, no atomics) in y's dtype.

    y [R, H] fp32/fp16/bf16; row_of_slot [T, K] int64; weights [T, K] fp32. A row index outside
    [0, R) contributes nothing (a dropped slot).
    """
    op, host = "unpermute_combine", host_emulation
    require_ext(op)
    check(y, "y", op, dtypes=list(COMBINE_DTYPES), dim=2, host=host)
    check(row_of_slot, "row_of_slot", op, device=y.device, dtypes=[torch.int64], dim=2, host=host)
    check(weights, "weights", op, device=y.device, dtypes=[torch.float32], dim=2, host=host)
    if weights.shape != row_of_slot.shape:
        raise ValueError(
            f"{op}: weights must have row_of_slot's shape {tuple(row_of_slot.shape)}, got {tuple(weights.shape)}"
        )
    tokens, top_k = row_of_slot.shape
    shape = (tokens, y.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=y.dtype, device=y.device)
    else:
        check_out(out, shape, y.dtype, y.device, op, host=host)
    launch(
        y.device,
        "unpermute_combine",
        host,
        y.data_ptr(),
        row_of_slot.data_ptr(),
        weights.data_ptr(),
        out.data_ptr(),
        y.shape[0],
        tokens,
        top_k,
        y.shape[1],
        COMBINE_DTYPES[y.dtype],
    )
    return out
