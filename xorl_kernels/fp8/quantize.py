"""On-the-fly FP8 quantisation of a 2-D tensor in blocks: one scale per block, computed from its amax.

``quantize_blocks(x, block_rows, block_cols, dtype) -> (q, scale)``: ``x`` [R, C] is cut into
``block_rows x block_cols`` blocks (the last ones may be partial); each block gets the scale that
maps its absolute maximum onto the largest finite value of ``dtype``, and
``x ≈ q * scale`` elementwise, ``scale`` [ceil(R / block_rows), ceil(C / block_cols)] being the
DEQUANTISATION factor (what ``torch._scaled_mm`` takes). The granularities of the recipes are
special cases: tensorwise (block = the whole tensor), rowwise (1 x C), DeepSeek-V3's 1 x 128
(activations) and 128 x 128 (weights).

The scale arithmetic is torchao's (``torchao.float8.float8_utils``: ``amax_to_scale`` in float64
then float32, rounded down to a power of 2, and ``to_fp8_saturated``), so the numbers are the ones
torchao's float8 training produces. Why powers of 2: the dequantisation factor is then the exact
reciprocal of the quantisation factor, so ``q * scale`` is exactly what the GEMM multiplies and
the float64 reference of the formula needs no tolerance for the scales themselves. torchao is
imported on first use: it loads in seconds and only FP8 runs need it.

Dispatch (``xorl_kernels.dispatch.pick_backend``): on CUDA tensors the casts are fused Triton kernels
(``triton_quantize.py``: one read of the operand, one write of q, scales computed in the kernel, no
host sync, transposed views and partial blocks read in place); on CPU, or with XORL_FORCE_REFERENCE,
the plain-torch functions here (``*_reference``), which are the kernels' references: the kernels' q
and scales are bit for bit theirs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
BLOCK = 128  # DeepSeek-V3's block edge: 1 x 128 activation tiles, 128 x 128 weight blocks
_AVAILABLE = (TRITON, REFERENCE)
# The recipes' blocks (linear.OPERANDS): the ones the Triton kernels cast; others run the reference.
_KERNEL_BLOCKS = ((None, None), (1, None), (1, BLOCK), (BLOCK, BLOCK))


@functools.cache
def _torchao_scaling():
    try:
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    except ImportError as error:  # the config rule for train.fp8 names the fix before start-up
        raise RuntimeError("FP8 training needs torchao (pip install torchao); set train.fp8: none") from error
    return amax_to_scale, to_fp8_saturated


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _backend(x: torch.Tensor, backend: str | None) -> str:
    return pick_backend("fp8_quantize", [x], _AVAILABLE, backend)


@torch.no_grad()
def quantize_blocks(
    x: torch.Tensor, block_rows: int | None, block_cols: int | None, dtype: torch.dtype = E4M3,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] -> (q [..., R, C] in ``dtype``, scale [..., ceil(R/br), ceil(C/bc)] float32).

    ``None`` for a block edge means the whole dim; leading dims (stacked experts) are independent.
    ``backend``: None picks (module docstring), "triton" (CPU needs TRITON_INTERPRET=1) or "reference".
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_blocks expects a tensor of at least 2 dims, got shape {tuple(x.shape)}")
    if _backend(x, backend) == TRITON and (block_rows, block_cols) in _KERNEL_BLOCKS:
        from xorl_kernels.fp8.triton_quantize import quantize_blocks_triton

        return quantize_blocks_triton(x, block_rows, block_cols, dtype)
    return quantize_blocks_reference(x, block_rows, block_cols, dtype)


@torch.no_grad()
def quantize_blocks_reference(x: torch.Tensor, block_rows: int | None, block_cols: int | None,
                              dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blocks`` in plain torch ops."""
    x = x.contiguous()  # transposed operands (dgrad / wgrad) arrive as views
    *lead, rows, cols = x.shape
    br = rows if block_rows is None else min(block_rows, rows)
    bc = cols if block_cols is None else min(block_cols, cols)
    nr, nc = _cdiv(rows, br), _cdiv(cols, bc)
    # Zero padding to whole blocks changes no amax and is cropped after the cast.
    padded = F.pad(x, (0, nc * bc - cols, 0, nr * br - rows)) if (nr * br, nc * bc) != (rows, cols) else x
    blocks = padded.view(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    q, qscale = cast_with_amax_reference(blocks, amax, dtype)
    q = q.view(*lead, nr * br, nc * bc)
    return q[..., :rows, :cols].contiguous(), qscale.view(*lead, nr, nc).reciprocal()


@torch.no_grad()
def cast_with_amax(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = E4M3, backend: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to ``dtype`` with the scale that ``amax`` (broadcastable to x) gives:
    (q, quantisation scale, float32, the reciprocal of the dequantisation factor).

    The one place the cast happens, so a tensor cast with the amax of its whole (a weight shard
    under FSDP's float8 all-gather, ``xorl.nn.fp8_all_gather``; a TP activation shard, ``xorl.nn.tp_fp8``)
    is bit for bit the cast of the whole: the Triton kernel takes a non-empty 2-D x [R, C] and a
    one-element amax or one per row ([R, 1]); else the reference.
    """
    if _backend(x, backend) == TRITON and x.dim() == 2 and x.numel() and (
            amax.numel() == 1 or tuple(amax.shape) == (x.shape[0], 1)):
        from xorl_kernels.fp8.triton_quantize import cast_with_amax_triton

        return cast_with_amax_triton(x, amax, dtype)
    return cast_with_amax_reference(x, amax, dtype)


def cast_with_amax_reference(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = E4M3
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cast_with_amax`` in plain torch ops: torchao's scale and saturating cast."""
    amax_to_scale, to_fp8_saturated = _torchao_scaling()
    qscale = amax_to_scale(amax.float(), dtype, round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.float() * qscale, dtype), qscale


def expand_block_scale(scale: torch.Tensor, block: int, size: int, dim: int) -> torch.Tensor:
    """Repeat each entry of ``scale`` along ``dim`` ``block`` times and crop to ``size``: a block
    scale as a per-row (or per-column) one, e.g. a weight's 128 x 128 scales as per-row 1 x 128."""
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)


def group_token_tiles(group_sizes: torch.Tensor, rows: int, tile: int = BLOCK):
    """Token tiles that never straddle groups, for the weight-gradient GEMM of grouped experts.

    Rows are sorted by group (``group_sizes`` [G]); tile j of group g is its rows
    ``[start_g + j * tile, min(start_g + (j + 1) * tile, end_g))`` (DeepSeek-V3 pads each expert
    to whole tiles; starting each group's tiles at its first row is the same grid without the
    padding). Returns ``(tile_of_row [rows], row_start [G], first_tile [G], num_tiles_bound)``, all
    on the device (no host sync: the bound ``ceil(rows / tile) + G`` is static, unused tiles stay empty).
    """
    sizes = group_sizes.to(torch.int64).clamp(min=0)
    tiles = (sizes + tile - 1) // tile
    row_start = torch.cumsum(sizes, 0) - sizes
    first_tile = torch.cumsum(tiles, 0) - tiles
    group = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=rows)
    local = torch.arange(rows, device=sizes.device) - row_start[group]
    return first_tile[group] + local // tile, row_start, first_tile, _cdiv(rows, tile) + sizes.numel()


@torch.no_grad()
def quantize_token_tiles(x: torch.Tensor, group_sizes: torch.Tensor, tile_of_row: torch.Tensor, num_tiles: int,
                         dtype: torch.dtype = E4M3, backend: str | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] -> (q [M, C] in ``dtype``, scale [num_tiles, C] float32): one scale per token tile
    (``group_token_tiles`` of ``group_sizes``: ``tile_of_row``, ``num_tiles``) and column, i.e. 1 x 128
    tiles along the token dim of x^T. The Triton kernel finds the tiles from ``group_sizes``."""
    if _backend(x, backend) == TRITON:
        from xorl_kernels.fp8.triton_quantize import quantize_token_tiles_triton

        return quantize_token_tiles_triton(x, group_sizes, num_tiles, dtype)
    return quantize_token_tiles_reference(x, tile_of_row, num_tiles, dtype)


@torch.no_grad()
def quantize_token_tiles_reference(x: torch.Tensor, tile_of_row: torch.Tensor, num_tiles: int,
                                   dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_token_tiles`` in plain torch ops."""
    x = x.contiguous()
    return cast_token_tiles_reference(x, tile_of_row, token_tile_amax(x, tile_of_row, num_tiles), dtype)


@torch.no_grad()
def token_tile_amax(x: torch.Tensor, tile_of_row: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """[num_tiles, C] float32: max |x| over each tile's rows of x [M, C], per column (0 for a tile
    without rows). Also a partial amax: a TP shard's rows of tiles that other ranks share
    (xorl/nn/tp_fp8.py), reduced (max) over the ranks before ``cast_token_tiles_reference``."""
    amax = x.new_zeros(num_tiles, x.shape[1], dtype=torch.float32)
    return amax.scatter_reduce_(0, tile_of_row[:, None].expand(x.shape), x.abs().float(), "amax")


@torch.no_grad()
def cast_token_tiles_reference(x: torch.Tensor, tile_of_row: torch.Tensor, amax: torch.Tensor,
                               dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] cast with the scale of its row's tile's ``amax`` [num_tiles, C]: (q [M, C], the
    dequantisation scale [num_tiles, C])."""
    amax_to_scale, to_fp8_saturated = _torchao_scaling()
    qscale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=True)
    q = to_fp8_saturated(x.float() * qscale.index_select(0, tile_of_row), dtype)
    return q, qscale.reciprocal()
