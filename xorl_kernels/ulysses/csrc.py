"""Checked wrappers around the extension's Ulysses all-to-all pack / unpack (block transposes).

Its one job: check the shapes given to a Ulysses pack or unpack (forward: split heads; reverse:
split the sequence), allocate or check the [world, D] buffer and outputs, describe each tensor's
strided copy as block-transpose segments and launch ``_C.block_transpose`` through the shared
checks and ``launch`` of ``xorl_kernels.cuda_ext``. The layouts are documented in ulysses/reference.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xorl_kernels.cuda_ext import check, check_out, launch, require_ext
from xorl_kernels.ulysses.layout import ulysses_piece_numels


def _pack_inputs(tensors: Sequence[torch.Tensor], world: int, split_dim: int, op: str, host: bool):
    """(first tensor, per-destination element counts) after checking the tensors to pack."""
    require_ext(op)
    numels = ulysses_piece_numels([tuple(t.shape) for t in tensors], world, split_dim, op)
    first = tensors[0]
    for i, t in enumerate(tensors):
        check(t, f"tensors[{i}]", op, device=first.device, dtypes=[first.dtype], dim=4, host=host)
    return first, numels


def _pack_buffer(out, world, numels, like: torch.Tensor, op: str, host: bool) -> torch.Tensor:
    shape = (world, sum(numels))
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_out(out, shape, like.dtype, like.device, op, host=host)
    return out


def _unpack_inputs(recv, world, shapes, split_dim, outs, op, host):
    """(per-source element counts, out tensors or Nones) after checking the received buffer."""
    require_ext(op)
    numels = ulysses_piece_numels(shapes, world, split_dim, op)
    check(recv, "recv", op, dim=2, host=host)
    if tuple(recv.shape) != (world, sum(numels)):
        raise ValueError(
            f"{op}: recv must be [world, sum of piece sizes] = {(world, sum(numels))} for these shapes, "
            f"got {tuple(recv.shape)}; pass the shapes every rank packed"
        )
    outs = list(outs) if outs is not None else [None] * len(shapes)
    if len(outs) != len(shapes):
        raise ValueError(f"{op}: pass one out tensor per shape ({len(shapes)}), got {len(outs)}")
    return numels, outs


def _unpack_output(out, shape, recv, op, host) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=recv.dtype, device=recv.device)
    check_out(out, shape, recv.dtype, recv.device, op, host=host)
    return out


# Every segment below is (src, dst, a_count, b_count, bytes, src_stride_a, src_stride_b,
# dst_stride_a, dst_stride_b): `bytes` bytes move from src + a*src_stride_a + b*src_stride_b to
# dst + a*dst_stride_a + b*dst_stride_b (csrc/xorl_kernels.h). `chunk` is one destination's row
# of the [world, D] buffer in bytes; `offset` is where a tensor's piece starts inside that row.


def ext_ulysses_pack(
    tensors: Sequence[torch.Tensor],
    world: int,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """Seq-sharded [b, s, H_t, d_t] tensors -> the all-to-all send buffer [world, D] (head group p to rank p)."""
    op, host = "ulysses_pack", host_emulation
    first, numels = _pack_inputs(tensors, world, 2, op, host)
    buf = _pack_buffer(out, world, numels, first, op, host)
    es = first.element_size()
    chunk, offset, segments = sum(numels) * es, 0, []
    for t, n in zip(tensors, numels):
        b, s, h, d = t.shape
        c = (h // world) * d * es  # a = token (b*s of them), b = destination p: one token's head group
        segments.append((t.data_ptr(), buf.data_ptr() + offset, b * s, world, c, world * c, c, c, chunk))
        offset += n * es
    launch(first.device, "block_transpose", host, segments)
    return buf


def ext_ulysses_unpack(
    recv: torch.Tensor,
    world: int,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor] | None = None,
    *,
    host_emulation: bool = False,
) -> list[torch.Tensor]:
    """Received [world, D] -> [b, world*s, H_t/world, d_t] per segment; ``shapes``: what every rank packed."""
    op, host = "ulysses_unpack", host_emulation
    numels, outs = _unpack_inputs(recv, world, shapes, 2, outs, op, host)
    es = recv.element_size()
    chunk, offset, segments, results = sum(numels) * es, 0, [], []
    for (b, s, h, d), n, out in zip(shapes, numels, outs):
        y = _unpack_output(out, (b, world * s, h // world, d), recv, op, host)
        run = s * (h // world) * d * es  # a = source p, b = batch row: one source's sequence chunk
        segments.append((recv.data_ptr() + offset, y.data_ptr(), world, b, run, chunk, run, run, world * run))
        results.append(y)
        offset += n * es
    launch(recv.device, "block_transpose", host, segments)
    return results


def ext_ulysses_pack_reverse(
    tensors: Sequence[torch.Tensor],
    world: int,
    out: torch.Tensor | None = None,
    *,
    host_emulation: bool = False,
) -> torch.Tensor:
    """Head-sharded [b, S, h_t, d_t] tensors -> the send buffer [world, D] (sequence chunk p to rank p)."""
    op, host = "ulysses_pack_reverse", host_emulation
    first, numels = _pack_inputs(tensors, world, 1, op, host)
    buf = _pack_buffer(out, world, numels, first, op, host)
    es = first.element_size()
    chunk, offset, segments = sum(numels) * es, 0, []
    for t, n in zip(tensors, numels):
        b, s, h, d = t.shape
        run = (s // world) * h * d * es  # a = destination p, b = batch row: one sequence chunk
        segments.append((t.data_ptr(), buf.data_ptr() + offset, world, b, run, run, world * run, chunk, run))
        offset += n * es
    launch(first.device, "block_transpose", host, segments)
    return buf


def ext_ulysses_unpack_reverse(
    recv: torch.Tensor,
    world: int,
    shapes: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor] | None = None,
    *,
    host_emulation: bool = False,
) -> list[torch.Tensor]:
    """Received [world, D] -> [b, S/world, world*h_t, d_t] per segment; ``shapes``: what every rank packed."""
    op, host = "ulysses_unpack_reverse", host_emulation
    numels, outs = _unpack_inputs(recv, world, shapes, 1, outs, op, host)
    es = recv.element_size()
    chunk, offset, segments, results = sum(numels) * es, 0, [], []
    for (b, s, h, d), n, out in zip(shapes, numels, outs):
        x = _unpack_output(out, (b, s // world, world * h, d), recv, op, host)
        c = h * d * es  # a = token (b*s/world of them), b = source p: one source's head group
        segments.append(
            (recv.data_ptr() + offset, x.data_ptr(), b * (s // world), world, c, c, chunk, world * c, c)
        )
        results.append(x)
        offset += n * es
    launch(recv.device, "block_transpose", host, segments)
    return results
