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
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
BLOCK = 128  # DeepSeek-V3's block edge: 1 x 128 activation tiles, 128 x 128 weight blocks


@functools.cache
def _torchao_scaling():
    try:
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    except ImportError as error:  # the config rule for train.fp8 names the fix before start-up
        raise RuntimeError("FP8 training needs torchao (pip install torchao); set train.fp8: none") from error
    return amax_to_scale, to_fp8_saturated


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.no_grad()
def quantize_blocks(
    x: torch.Tensor, block_rows: int | None, block_cols: int | None, dtype: torch.dtype = E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] -> (q [..., R, C] in ``dtype``, scale [..., ceil(R/br), ceil(C/bc)] float32).

    ``None`` for a block edge means the whole dim; leading dims (stacked experts) are independent.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_blocks expects a tensor of at least 2 dims, got shape {tuple(x.shape)}")
    x = x.contiguous()  # transposed operands (dgrad / wgrad) arrive as views
    *lead, rows, cols = x.shape
    br = rows if block_rows is None else min(block_rows, rows)
    bc = cols if block_cols is None else min(block_cols, cols)
    nr, nc = _cdiv(rows, br), _cdiv(cols, bc)
    # Zero padding to whole blocks changes no amax and is cropped after the cast.
    padded = F.pad(x, (0, nc * bc - cols, 0, nr * br - rows)) if (nr * br, nc * bc) != (rows, cols) else x
    blocks = padded.view(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    q, qscale = cast_with_amax(blocks, amax, dtype)
    q = q.view(*lead, nr * br, nc * bc)
    return q[..., :rows, :cols].contiguous(), qscale.view(*lead, nr, nc).reciprocal()


@torch.no_grad()
def cast_with_amax(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = E4M3
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to ``dtype`` with the scale that ``amax`` (broadcastable to x) gives:
    (q, quantisation scale, float32, the reciprocal of the dequantisation factor).

    The one place the cast happens, so a tensor cast with the amax of its whole (a weight shard
    under FSDP's float8 all-gather, ``xorl.nn.fp8_all_gather``) is bit for bit the cast of the whole.
    """
    amax_to_scale, to_fp8_saturated = _torchao_scaling()
    qscale = amax_to_scale(amax.float(), dtype, round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.float() * qscale, dtype), qscale


def expand_block_scale(scale: torch.Tensor, block: int, size: int, dim: int) -> torch.Tensor:
    """Repeat each entry of ``scale`` along ``dim`` ``block`` times and crop to ``size``: a block
    scale as a per-row (or per-column) one, e.g. a weight's 128 x 128 scales as per-row 1 x 128."""
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)
