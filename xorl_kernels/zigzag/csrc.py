"""Checked wrapper around the extension's zig-zag context-parallel shard copy.

Its one job: validate a full tensor and a zig-zag local shard (and optional ``cu_seqlens``), view
them as [outer, seq_len, row_bytes], and launch ``_C.zigzag_copy`` (gather or scatter) through the
shared checks and ``launch`` of ``xorl_kernels.cuda_ext``. The layout is documented in zigzag/layout.py.
"""

from __future__ import annotations

import torch

from xorl_kernels.cuda_ext import check, launch, require_ext


def _zigzag_view(t: torch.Tensor, dim: int) -> tuple[int, int]:
    """(outer, row_bytes) of ``t`` viewed as [outer, t.shape[dim], row_bytes]."""
    outer = 1
    for size in t.shape[:dim]:
        outer *= size
    inner = 1
    for size in t.shape[dim + 1 :]:
        inner *= size
    return outer, inner * t.element_size()


def ext_zigzag_copy(
    full: torch.Tensor,
    local: torch.Tensor,
    dim: int,
    rank_begin: int,
    num_ranks: int,
    world: int,
    cu_seqlens: torch.Tensor | None,
    scatter: bool,
    *,
    host_emulation: bool = False,
) -> None:
    """local <- full at the zig-zag rows of ranks [rank_begin, rank_begin+num_ranks) (or the inverse).

    ``full`` and ``local`` agree on every dim but ``dim``, where full has seq_len rows and local
    num_ranks * seq_len / world. ``cu_seqlens``: int64 on the same device, or None. The argument
    rules (divisibility, document lengths) are checked by zigzag/op.py.
    ``host_emulation``: run the kernel's index map on CPU tensors (tests without a GPU).
    """
    op = "zigzag_scatter" if scatter else "zigzag_gather"
    require_ext(op)
    host = host_emulation
    check(full, "full tensor", op, host=host)
    check(local, "local shard", op, device=full.device, dtypes=[full.dtype], dim=full.dim(), host=host)
    seq_len = full.shape[dim]
    if world < 1 or seq_len % (2 * world) != 0 or not 0 <= rank_begin <= rank_begin + num_ranks <= world:
        raise ValueError(
            f"{op}: need world >= 1 dividing seq_len / 2 and 0 <= rank_begin <= rank_begin + num_ranks <= world; "
            f"got seq_len={seq_len}, world={world}, rank_begin={rank_begin}, num_ranks={num_ranks}"
        )
    expected = list(full.shape)
    expected[dim] = num_ranks * (seq_len // world)
    if list(local.shape) != expected:
        raise ValueError(f"{op}: the local shard must have shape {tuple(expected)}, got {tuple(local.shape)}")
    cu_ptr, num_docs = 0, 0
    if cu_seqlens is not None:
        check(cu_seqlens, "cu_seqlens", op, device=full.device, dtypes=[torch.int64], dim=1, host=host)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"{op}: cu_seqlens needs num_docs + 1 >= 2 entries, got {cu_seqlens.numel()}")
        cu_ptr, num_docs = cu_seqlens.data_ptr(), cu_seqlens.numel() - 1
    outer, row_bytes = _zigzag_view(full, dim)
    launch(
        full.device,
        "zigzag_copy",
        host,
        full.data_ptr(),
        local.data_ptr(),
        outer,
        seq_len,
        row_bytes,
        cu_ptr,
        num_docs,
        rank_begin,
        num_ranks,
        world,
        scatter,
    )
