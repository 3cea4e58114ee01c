"""Triton kernel: blockwise-scaled FP8 grouped GEMM (DeepSeek-V3's recipe).

``c[rows of g] = (qa * sa)[rows of g] @ (qb[g] * sb[g])`` with

- ``qa`` [M, K] fp8, rows sorted by group; ``sa`` [M, ceil(K/128)] float32: one scale per 1 x 128
  tile of a row (activations);
- ``qb`` [G, K, N] fp8 (any strides); ``sb`` [G, ceil(K/128), S] float32 with ``S = ceil(N / SB_N)``:
  one scale per 128 x 128 block (weights, ``SB_N = 128``) or per 128 x 1 column slice (``SB_N = 1``,
  the token-major operand of a weight gradient);
- ``c`` [M, N] in the output dtype; products accumulate in float32.

Each program owns a BLOCK_M x BLOCK_N output tile and walks K in steps of 128, the scale block:
one fp8 ``tl.dot`` per step, whose float32 result is multiplied by the row scales of ``a`` and the
column scales of ``b`` for that step before it is added (the scales differ per step, so they
cannot be applied once at the end). The group of an m-tile is found on the device from
``group_sizes`` exactly as in the 16-bit grouped GEMM (``_group_of_tile``, shared), so there is no
host sync. A dense blockwise linear is the same kernel with one group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting
from xorl_kernels.expert_gemm.triton_kernels import _block_g, _group_of_tile

SCALE_BLOCK = 128


@triton.jit(do_not_specialize=["M", "num_tiles_m_bound"])
def _fp8_blockwise_grouped_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, sizes_ptr,
    M, N, K, G, num_tiles_m_bound,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_bg, stride_bk, stride_bn, stride_sbg, stride_sbk, stride_sbn,
    stride_cm, stride_cn,
    SB_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    programs_per_band = GROUP_M * num_tiles_n
    band = pid // programs_per_band
    first_tile_m = band * GROUP_M
    band_height = tl.minimum(num_tiles_m_bound - first_tile_m, GROUP_M)
    tile_m = first_tile_m + (pid % programs_per_band) % band_height
    tile_n = (pid % programs_per_band) // band_height

    total_tiles, group, row_start, rows_left = _group_of_tile(sizes_ptr, G, M, tile_m, BLOCK_M, BLOCK_G)
    if tile_m >= total_tiles:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < rows_left
    col_mask = offs_n < N
    rows = (row_start + offs_m).to(tl.int64)
    g64 = group.to(tl.int64)

    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + g64 * stride_bg + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    sa_ptrs = sa_ptr + rows * stride_sam
    sb_ptrs = sb_ptr + g64 * stride_sbg + (offs_n // SB_N) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # K blocks of 128 (the scale block; BLOCK_K divides it): this step's scales.
        kblock = (kb * BLOCK_K) // 128
        sa = tl.load(sa_ptrs + kblock * stride_sak, mask=row_mask, other=0.0)
        sb = tl.load(sb_ptrs + kblock * stride_sbk, mask=col_mask, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def fp8_blockwise_grouped_forward(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, group_sizes: torch.Tensor,
    out_dtype: torch.dtype, sb_block_n: int = SCALE_BLOCK, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel (inputs trusted: the op in ``grouped.py`` / ``linear.py`` builds them)."""
    m, k = qa.shape
    num_groups, _, n = qb.shape
    c = torch.empty((m, n), dtype=out_dtype, device=qa.device) if out is None else out
    if c.numel() == 0:
        return c
    if triton_interpreting():  # small tiles: CPU tests use small shapes and must cross tile edges
        block_m, block_n, block_k, group_m, warps, stages = 16, 32, 64, 2, 4, 1
    else:  # H100: 128 x 128 output tiles, a K step of 128 (one scale block) per dot
        block_m = 64 if m / num_groups < 64 else 128
        block_n, block_k, group_m, warps, stages = 128, 128, 8, 8, 3
    tiles_m_bound = triton.cdiv(m, block_m) + num_groups
    grid = (tiles_m_bound * triton.cdiv(n, block_n),)
    _fp8_blockwise_grouped_kernel[grid](
        qa, sa, qb, sb, c, group_sizes,
        m, n, k, num_groups, tiles_m_bound,
        qa.stride(0), qa.stride(1), sa.stride(0), sa.stride(1),
        qb.stride(0), qb.stride(1), qb.stride(2), sb.stride(0), sb.stride(1), sb.stride(2),
        c.stride(0), c.stride(1),
        SB_N=sb_block_n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_G=_block_g(num_groups), GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )
    return c


# -- weight gradient: dw[g] = (qa * sa)[rows of g]^T @ (qb * sb)[rows of g] ----------------------------
@triton.jit
def _fp8_blockwise_wgrad_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, sizes_ptr, starts_ptr, first_tile_ptr,
    K, N,
    stride_am, stride_ak, stride_sat, stride_sak,
    stride_bm, stride_bn, stride_sbt, stride_sbn,
    stride_cg, stride_ck, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    group = tl.program_id(0)
    pid = tl.program_id(1)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    offs_k = (pid // num_tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = (pid % num_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k_mask = offs_k < K
    n_mask = offs_n < N
    size = tl.maximum(tl.load(sizes_ptr + group).to(tl.int32), 0)
    start = tl.load(starts_ptr + group).to(tl.int64)
    first_tile = tl.load(first_tile_ptr + group).to(tl.int64)

    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    # The contraction runs over this group's tokens in steps of BLOCK_M, which divides the 128-token
    # scale tile, so each step has one scale per column of a and of b (an empty group: no step, dw = 0).
    for m0 in range(0, size, BLOCK_M):
        row_mask = offs_m < size - m0
        rows = start + m0 + offs_m
        a = tl.load(a_ptr + rows[None, :] * stride_am + offs_k[:, None] * stride_ak,
                    mask=k_mask[:, None] & row_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]: x^T
        b = tl.load(b_ptr + rows[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                    mask=row_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
        tile = first_tile + m0 // 128
        sa = tl.load(sa_ptr + tile * stride_sat + offs_k * stride_sak, mask=k_mask, other=0.0)
        sb = tl.load(sb_ptr + tile * stride_sbt + offs_n * stride_sbn, mask=n_mask, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]

    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + offs_k[:, None] * stride_ck + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


def fp8_blockwise_grouped_wgrad(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, group_sizes: torch.Tensor,
    row_start: torch.Tensor, first_tile: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``c[g] = (qa * sa)[rows of g]^T @ (qb * sb)[rows of g]`` -> [G, K, N].

    ``qa`` [M, K] and ``qb`` [M, N] fp8, rows sorted by group; ``sa`` [T, K] and ``sb`` [T, N]: one
    scale per token tile of a group and column (``quantize.group_token_tiles`` /
    ``quantize_token_tiles``), tile j of group g being ``first_tile[g] + j``.
    """
    m, k = qa.shape
    n = qb.shape[1]
    num_groups = group_sizes.numel()
    c = torch.empty((num_groups, k, n), dtype=out_dtype, device=qa.device) if out is None else out
    if c.numel() == 0:
        return c
    if triton_interpreting():  # small tiles: CPU tests use small shapes and must cross tile edges
        block_m, block_k, block_n, warps, stages = 32, 32, 32, 4, 1
    else:  # H100: a 128 x 128 tile of dw per program, one 128-token scale tile per step
        block_m, block_k, block_n, warps, stages = 128, 128, 128, 8, 3
    grid = (num_groups, triton.cdiv(k, block_k) * triton.cdiv(n, block_n))
    _fp8_blockwise_wgrad_kernel[grid](
        qa, sa, qb, sb, c, group_sizes, row_start, first_tile,
        k, n,
        qa.stride(0), qa.stride(1), sa.stride(0), sa.stride(1),
        qb.stride(0), qb.stride(1), sb.stride(0), sb.stride(1),
        c.stride(0), c.stride(1), c.stride(2),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )
    return c
