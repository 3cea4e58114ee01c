"""Zig-zag gather / scatter in plain torch: the references the csrc kernel is checked against.

``index_select`` / ``index_copy_`` at ``zigzag_positions`` (the layout, documented in
zigzag/layout.py). zigzag/op.py dispatches between these and the csrc kernel.
"""

from __future__ import annotations

import torch

from xorl_kernels.zigzag.layout import (
    check_args,
    check_scatter_out,
    check_seq_len,
    new_scatter_out,
    prepare_cu_seqlens,
    scatter_seq_len,
    zigzag_positions,
)


def zigzag_gather_reference(
    x: torch.Tensor, dim: int, rank: int | None, world: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    dim = check_args("zigzag_gather", x, dim, rank, world)
    seq_len = x.shape[dim]
    check_seq_len("zigzag_gather", seq_len, world, cu_seqlens)
    cu = prepare_cu_seqlens("zigzag_gather", cu_seqlens, seq_len, world, x.device)
    return x.index_select(dim, zigzag_positions(seq_len, rank, world, cu, x.device))


def zigzag_scatter_reference(
    y: torch.Tensor,
    dim: int,
    rank: int | None,
    world: int,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    dim = check_args("zigzag_scatter", y, dim, rank, world)
    seq_len = scatter_seq_len(y, dim, rank, world)
    check_seq_len("zigzag_scatter", seq_len, world, cu_seqlens)
    cu = prepare_cu_seqlens("zigzag_scatter", cu_seqlens, seq_len, world, y.device)
    if out is None:
        out = new_scatter_out(y, dim, rank, seq_len)
    else:
        check_scatter_out(out, y, dim, seq_len)
    return out.index_copy_(dim, zigzag_positions(seq_len, rank, world, cu, y.device), y)
