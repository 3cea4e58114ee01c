"""Triton kernels for grouped GEMM: forward / input-gradient, and weight-gradient.

Both kernels read ``group_sizes`` on the device and never sync with the host:

- forward (also used for dx with a transposed view of w): a grid over an upper bound of
  (m-tile, n-tile) pairs. The m-tiles of all groups are numbered one after another; there are at
  most ``cdiv(M, BLOCK_M) + G`` of them (each group adds at most one partial tile). Every program
  loads all G sizes as one small vector, takes a prefix sum of tiles per group, finds its group
  by counting the groups that end at or before its tile, and exits if its tile lies past the last
  one. That costs a few hundred register ops per program and no extra launch, which beats a
  separate prologue kernel for G up to a few thousand.
- weight gradient: a grid over (group, k-tile, n-tile); each program reduces over its group's
  rows, so a group with no rows stores an exact zero tile.
- per-group bias (gpt-oss experts): the forward adds ``bias[g]`` to the fp32 accumulator before
  its one rounding (``HAS_BIAS``, a constexpr: the bias-free kernel is unchanged); its gradient
  ``db[g]`` (the sum of dy's rows of g) is a grid over (group, n-tile) of the same shape as the
  weight gradient's reduction.

Addresses are int64 (M·K and G·K·N can exceed 2**31); tile bookkeeping stays int32 (row counts
fit). Sizes are clamped at 0 and rows at M so a wrong ``group_sizes`` can never make a kernel read
or write out of bounds (the public wrapper documents the contract and checks it where it is free).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows of x per tile (forward); rows reduced per step (weight gradient)
    block_n: int
    block_k: int
    group_m: int  # grouped-M swizzle width: consecutive programs reuse the same weight columns in L2
    num_warps: int
    num_stages: int


def _interpreting() -> bool:
    return triton_interpreting()  # per call: the tests switch it to see the GPU tile configs


# Small tiles under the interpreter: CPU tests use small shapes and must still cross tile edges.
_INTERPRET_CONFIG = TileConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)


def forward_config(m: int, n: int, k: int, num_groups: int, dtype: torch.dtype) -> TileConfig:
    """Tiles for ``[M, K] @ [G, K, N]`` from host-known shapes only (no look at the sizes' values).

    H100-oriented: 128x128x64, 8 warps, 4 stages for 16-bit inputs. Fine-grained experts with few
    rows per group (mean < 64, e.g. many experts at small token counts) waste most of a 128-row
    tile on padding, so they get 64-row tiles. fp32 halves BLOCK_K to fit the same shared memory.
    """
    if _interpreting():
        return _INTERPRET_CONFIG
    mean_rows = m / max(num_groups, 1)
    block_m = 64 if mean_rows < 64 else 128
    block_n = 64 if n <= 64 else 128
    block_k = 32 if dtype == torch.float32 else 64
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    num_stages = 3 if dtype == torch.float32 else 4
    return TileConfig(block_m, block_n, block_k, group_m=8, num_warps=num_warps, num_stages=num_stages)


def weight_grad_config(m: int, n: int, k: int, num_groups: int, dtype: torch.dtype) -> TileConfig:
    """Tiles for ``dw[g] = x_g^T @ dy_g``: a [BLOCK_K, BLOCK_N] output tile, BLOCK_M rows per step."""
    if _interpreting():
        return _INTERPRET_CONFIG
    block_m = 32 if dtype == torch.float32 else 64
    block_n = 64 if n <= 64 else 128
    block_k = 64 if k <= 64 else 128
    num_warps = 8 if block_k * block_n >= 128 * 128 else 4
    num_stages = 3 if dtype == torch.float32 else 4
    return TileConfig(block_m, block_n, block_k, group_m=1, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _group_of_tile(sizes_ptr, G, M, tile_m, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """For global m-tile ``tile_m``: (number of real tiles, its group, its first row, rows left in it)."""
    offs_g = tl.arange(0, BLOCK_G)
    sizes = tl.load(sizes_ptr + offs_g, mask=offs_g < G, other=0).to(tl.int32)
    sizes = tl.maximum(sizes, 0)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    total_tiles = tl.sum(tiles, 0)
    group = tl.sum((tile_end <= tile_m).to(tl.int32), 0)
    before = offs_g < group
    group_row_start = tl.sum(tl.where(before, sizes, 0), 0)
    group_first_tile = tl.sum(tl.where(before, tiles, 0), 0)
    group_rows = tl.sum(tl.where(offs_g == group, sizes, 0), 0)
    tile_row_start = group_row_start + (tile_m - group_first_tile) * BLOCK_M
    # Rows of this tile that belong to the group, never past M (guards a bad sum(group_sizes)).
    rows_left = tl.minimum(group_row_start + group_rows, M) - tile_row_start
    return total_tiles, group, tile_row_start, rows_left


# M changes every step in MoE training: not specialising on it avoids recompiling per step.
@triton.jit(do_not_specialize=["M", "num_tiles_m_bound"])
def _grouped_gemm_fwd_kernel(
    a_ptr, b_ptr, c_ptr, sizes_ptr,
    M, N, K, G, num_tiles_m_bound,
    stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_cm, stride_cn,
    bias_ptr, stride_bias_g, stride_bias_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """c[rows of g] = a[rows of g] @ b[g] (+ bias[g]); a [M, K], b [G, K, N] (any strides), c [M, N]."""
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped-M swizzle over the (upper-bound) tile grid: GROUP_M m-tiles walk the n-tiles together.
    programs_per_band = GROUP_M * num_tiles_n
    band = pid // programs_per_band
    first_tile_m = band * GROUP_M
    band_height = tl.minimum(num_tiles_m_bound - first_tile_m, GROUP_M)
    tile_m = first_tile_m + (pid % programs_per_band) % band_height
    tile_n = (pid % programs_per_band) // band_height

    total_tiles, group, row_start, rows_left = _group_of_tile(sizes_ptr, G, M, tile_m, BLOCK_M, BLOCK_G)
    if tile_m >= total_tiles:  # past the last real tile of the upper-bound grid
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < rows_left
    col_mask = offs_n < N
    rows = (row_start + offs_m).to(tl.int64)

    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + group.to(tl.int64) * stride_bg + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + group.to(tl.int64) * stride_bias_g + offs_n * stride_bias_n, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]

    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _grouped_gemm_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, sizes_ptr,
    M, N, K, G,
    stride_xm, stride_xk,
    stride_dym, stride_dyn,
    stride_wg, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """dw[g] = x_g^T @ dy_g; x [M, K], dy [M, N], dw [G, K, N]. Grid: G * k-tiles * n-tiles."""
    pid = tl.program_id(0)
    num_tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = num_tiles_k * num_tiles_n
    group = pid // tiles_per_group
    tile_k = (pid % tiles_per_group) // num_tiles_n
    tile_n = pid % num_tiles_n

    offs_g = tl.arange(0, BLOCK_G)
    sizes = tl.maximum(tl.load(sizes_ptr + offs_g, mask=offs_g < G, other=0).to(tl.int32), 0)
    row_start = tl.minimum(tl.sum(tl.where(offs_g < group, sizes, 0), 0), M)
    group_rows = tl.minimum(tl.sum(tl.where(offs_g == group, sizes, 0), 0), M - row_start)

    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    rows = (row_start + offs_m).to(tl.int64)
    xt_ptrs = x_ptr + rows[None, :] * stride_xm + offs_k[:, None] * stride_xk  # x_g^T tile [BLOCK_K, BLOCK_M]
    dy_ptrs = dy_ptr + rows[:, None] * stride_dym + offs_n[None, :] * stride_dyn
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    # A group with no rows runs zero iterations and stores the zero tile.
    for step in range(0, tl.cdiv(group_rows, BLOCK_M)):
        row_mask = offs_m < group_rows - step * BLOCK_M
        xt = tl.load(xt_ptrs, mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION)
        xt_ptrs += BLOCK_M * stride_xm
        dy_ptrs += BLOCK_M * stride_dym

    dw_ptrs = dw_ptr + group.to(tl.int64) * stride_wg + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _grouped_bias_grad_kernel(
    dy_ptr, db_ptr, sizes_ptr,
    M, N, G,
    stride_dym, stride_dyn, stride_dbg, stride_dbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """db[g] = sum over the rows of g of dy; dy [M, N], db [G, N]. Grid: G * n-tiles."""
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // num_tiles_n
    tile_n = pid % num_tiles_n
    offs_g = tl.arange(0, BLOCK_G)
    sizes = tl.maximum(tl.load(sizes_ptr + offs_g, mask=offs_g < G, other=0).to(tl.int32), 0)
    row_start = tl.minimum(tl.sum(tl.where(offs_g < group, sizes, 0), 0), M)
    group_rows = tl.minimum(tl.sum(tl.where(offs_g == group, sizes, 0), 0), M - row_start)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dy_ptrs = dy_ptr + (row_start + offs_m).to(tl.int64)[:, None] * stride_dym + offs_n[None, :] * stride_dyn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(0, tl.cdiv(group_rows, BLOCK_M)):  # an empty group stores zeros
        row_mask = offs_m < group_rows - step * BLOCK_M
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(dy.to(tl.float32), 0)
        dy_ptrs += BLOCK_M * stride_dym
    tl.store(db_ptr + group.to(tl.int64) * stride_dbg + offs_n * stride_dbn, acc.to(db_ptr.dtype.element_ty),
             mask=n_mask)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 callers asked for fp32: no silent TF32 (it would cost ~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # The Triton interpreter multiplies bf16 tiles as their raw 16-bit integers (numpy has no
    # bf16), so under the interpreter bf16 tiles are widened first. Never on a GPU.
    return _interpreting() and dtype == torch.bfloat16


def _block_g(num_groups: int) -> int:
    return max(16, triton.next_power_of_2(num_groups))


def grouped_gemm_forward(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``c[rows of g] = a[rows of g] @ b[g] (+ bias[g])`` for a [M, K], b [G, K, N] (any strides),
    bias [G, N] or None -> c [M, N].

    Used for the forward (b = w) and for dx (a = dy, b = w.transpose(1, 2)). Inputs are trusted:
    the public wrapper ``grouped_gemm`` checks shapes and dtypes. ``out`` (optional, [M, N], a's
    dtype) is written in place; the tests pass a NaN-poisoned one to prove every row is written.
    """
    m, k = a.shape
    num_groups, _, n = b.shape
    c = torch.empty((m, n), dtype=a.dtype, device=a.device) if out is None else out
    if c.numel() == 0:
        return c
    if k == 0 and bias is None:
        return c.zero_()
    cfg = forward_config(m, n, k, num_groups, a.dtype)
    num_tiles_m_bound = triton.cdiv(m, cfg.block_m) + num_groups
    grid = (num_tiles_m_bound * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_fwd_kernel[grid](
        a, b, c, group_sizes,
        m, n, k, num_groups, num_tiles_m_bound,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        c if bias is None else bias, 0 if bias is None else bias.stride(0), 0 if bias is None else bias.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_G=_block_g(num_groups), GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
        INPUT_PRECISION=_input_precision(a.dtype), DOT_IN_FP32=_dot_in_fp32(a.dtype), HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def grouped_gemm_weight_grad(
    x: torch.Tensor,
    dy: torch.Tensor,
    group_sizes: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dw[g] = x_g^T @ dy_g`` for x [M, K], dy [M, N] -> dw [G, K, N] in ``out_dtype``.

    ``out`` (optional, [G, K, N]) is written in place, every element including zero-row groups.
    """
    m, k = x.shape
    n = dy.shape[1]
    num_groups = group_sizes.shape[0]
    dw = torch.empty((num_groups, k, n), dtype=out_dtype, device=x.device) if out is None else out
    if dw.numel() == 0:
        return dw
    if m == 0:
        return dw.zero_()
    cfg = weight_grad_config(m, n, k, num_groups, x.dtype)
    grid = (num_groups * triton.cdiv(k, cfg.block_k) * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_wgrad_kernel[grid](
        x, dy, dw, group_sizes,
        m, n, k, num_groups,
        x.stride(0), x.stride(1),
        dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_G=_block_g(num_groups), INPUT_PRECISION=_input_precision(x.dtype),
        DOT_IN_FP32=_dot_in_fp32(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dw


def grouped_bias_grad(dy: torch.Tensor, group_sizes: torch.Tensor, out_dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``db[g] = sum of dy[rows of g]`` (fp32 sums) for dy [M, N] -> db [G, N] in ``out_dtype``."""
    m, n = dy.shape
    num_groups = group_sizes.shape[0]
    db = torch.empty((num_groups, n), dtype=out_dtype, device=dy.device) if out is None else out
    if db.numel() == 0:
        return db
    if m == 0:
        return db.zero_()
    block_m, block_n = (16, 32) if _interpreting() else (64, 128)
    grid = (num_groups * triton.cdiv(n, block_n),)
    _grouped_bias_grad_kernel[grid](
        dy, db, group_sizes, m, n, num_groups,
        dy.stride(0), dy.stride(1), db.stride(0), db.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=_block_g(num_groups), num_warps=4,
    )
    return db
