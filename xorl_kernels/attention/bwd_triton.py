"""Triton flash-attention backward on the packed form: two kernels, no atomics, deterministic.

Given lse and delta (delta = rowsum(dO·O) - dlse, computed once per backward by the caller), with
P = exp(S·scale - lse), dP = dO·Vᵀ and dS = P ∘ (dP - delta):

- ``_flash_attn_bwd_dkdv_kernel``: one program per (document, kv head, query-head slice, key
  block); it loops over the query heads of its slice of the GQA group and over the visible query
  blocks, accumulating dV = Pᵀ·dO and dK = scale·dSᵀ·Q in fp32 registers. With one slice (MHA, or
  enough key blocks to fill the GPU) each dk/dv row is written exactly once; with S > 1 slices
  each program writes its fp32 partial to slice s of a [S, total_k, heads_kv, d] scratch and the
  S partials are summed afterwards in a fixed order (deterministic, no atomics). Why slices: with
  32 query / 4 KV heads at 4k tokens, one program per KV head and key block is 128 programs for
  132 SMs, each looping over 8 query heads, and causal masking gives the first key block 32x the
  work of the last; S slices give S times the programs, each doing 1/S of the heads.
- ``_flash_attn_bwd_dq_kernel``: one program per (document, query head, query block), looping
  over visible key blocks: dQ = scale·dS·K in fp32.

lse and delta may be global quantities of a larger attention (ring attention passes the merged
lse and the merged output's delta to every step); the formulas hold per key block. Rows with
lse = -inf (no visible key anywhere) are exponentiated against 0, so their P is exactly 0.

Results are written in the gradient buffers' dtype; ``ACCUMULATE`` adds into existing fp32
buffers instead (ring attention keeps fp32 accumulators across steps). Visibility and block
skipping are the forward's (see attention/fwd_triton.py and attention/bounds.py): bounds, same
document, under causal k_pos <= q_pos and with a window k_pos > q_pos - W, with per-block
position ranges. q·k head dims may run as two chunks and v has its own head dim
(common.qk_chunks). Sinks change nothing here (lse includes them; attention/sinks.py gives their
gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.attention import common
from xorl_kernels.attention.bounds import query_range, query_tile_visible
from xorl_kernels.attention.bwd_dq_triton import (
    _flash_attn_bwd_dq_kernel,
    bwd_configs,
    load_row_stats,
    restore_on_tuning,
)
from xorl_kernels.attention.common import (
    LOG2E,
    block_head_dim,
    check_device,
    dot_precision,
    last_dim_contiguous,
    load_positions,
    load_tile,
    qk_chunks,
    scan_block,
    seq_bucket,
    store_tile,
    upcast_16bit,
)
from xorl_kernels.attention.dkdv_splits import device_sms, dkdv_head_splits


@triton.jit
def _dkdv_block(
    dk_a, dk_b, dv, k_a, k_b, v, k_pos, n_valid, Q_base, DO_base, LSE, DELTA, QPOS, head, stride_lse_h,
    q_start, start_m, q_len, window, stride_qt, stride_dot, sm_scale_log2, offs_m_base, offs_a, offs_b, offs_v,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_A: tl.constexpr, BLOCK_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_B: tl.constexpr,
    HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    offs_m = start_m + offs_m_base
    m_valid = offs_m < q_len
    q_a = load_tile(Q_base, offs_m, stride_qt, offs_a, m_valid, HEAD_A, BLOCK_A, UPCAST)
    do = load_tile(DO_base, offs_m, stride_dot, offs_v, m_valid, HEAD_V, BLOCK_V, UPCAST)
    lse, delta = load_row_stats(LSE, DELTA, head, stride_lse_h, q_start, offs_m, m_valid)
    qk_t = tl.dot(k_a, tl.trans(q_a), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
    q_b = q_a
    if HEAD_B > 0:
        q_b = load_tile(Q_base + BLOCK_A, offs_m, stride_qt, offs_b, m_valid, HEAD_B, BLOCK_B, UPCAST)
        qk_t = tl.dot(k_b, tl.trans(q_b), qk_t, input_precision=DOT_PREC)
    qk_t = qk_t * sm_scale_log2
    if MASKED:
        visible = n_valid[:, None] & m_valid[None, :]
        if IS_CAUSAL:
            q_pos = load_positions(QPOS, q_start, offs_m, m_valid, HAS_POS)
            visible = visible & (k_pos[:, None] <= q_pos[None, :])
            if HAS_WINDOW:
                visible = visible & (k_pos[:, None] > q_pos[None, :] - window)
        qk_t = tl.where(visible, qk_t, float("-inf"))
    p_t = tl.math.exp2(qk_t - lse[None, :])
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q_a.dtype)
    dk_a = tl.dot(ds_t, q_a, dk_a, input_precision=DOT_PREC)
    if HEAD_B > 0:
        dk_b = tl.dot(ds_t, q_b, dk_b, input_precision=DOT_PREC)
    return dk_a, dk_b, dv


@triton.autotune(
    configs=bwd_configs("BLOCK_N", "BLOCK_M"),
    key=["seq_bucket", "HEAD_A", "HEAD_B", "HEAD_V", "IS_CAUSAL", "HAS_POS", "HAS_WINDOW", "DOT_PREC",
         "ACCUMULATE", "splits"],
    restore_value=restore_on_tuning(["DK", "DV", "TILES"]),
)
@triton.jit
def _flash_attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, QPOS, KPOS, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dks, stride_dvt, stride_dvh, stride_dvs, stride_lse_h,
    sm_scale, sm_scale_log2, heads_kv, group, splits, window, seq_bucket,
    HEAD_A: tl.constexpr, BLOCK_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_B: tl.constexpr,
    HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, COUNT_TILES: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The slices of one KV head are neighbours in launch order, so they run together and share
    # their K/V tiles through L2.
    pid_dhs = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = pid_dhs % splits
    kv_head = (pid_dhs // splits) % heads_kv
    doc = pid_dhs // (splits * heads_kv)
    k_start = tl.load(CU_K + doc)
    k_len = tl.load(CU_K + doc + 1) - k_start
    if pid_n * BLOCK_N >= k_len:
        return
    q_start = tl.load(CU_Q + doc)
    q_len = tl.load(CU_Q + doc + 1) - q_start

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, BLOCK_A)
    offs_b = tl.arange(0, BLOCK_B)
    offs_v = tl.arange(0, BLOCK_V)
    n_valid = offs_n < k_len
    K_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    k_a = load_tile(K_base, offs_n, stride_kt, offs_a, n_valid, HEAD_A, BLOCK_A, UPCAST)
    k_b = k_a
    if HEAD_B > 0:
        k_b = load_tile(K_base + BLOCK_A, offs_n, stride_kt, offs_b, n_valid, HEAD_B, BLOCK_B, UPCAST)
    v = load_tile(V_base, offs_n, stride_vt, offs_v, n_valid, HEAD_V, BLOCK_V, UPCAST)
    k_pos = load_positions(KPOS, k_start, offs_n, n_valid, HAS_POS)
    dk_a = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    dk_b = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)  # stays 0 without a second chunk
    dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)

    lo, mid, full_hi, q_end, k_lo, k_hi = query_range(
        QPOS, q_start, q_len, k_pos, n_valid, pid_n * BLOCK_N, k_len, window,
        IS_CAUSAL, HAS_POS, HAS_WINDOW, SCAN, BLOCK_M, BLOCK_N,
    )
    tiles = q_len * 0
    heads_per_split = group // splits
    for g in range(split * heads_per_split, (split + 1) * heads_per_split):
        head = kv_head * group + g
        Q_base = Q + q_start.to(tl.int64) * stride_qt + head * stride_qh
        DO_base = DO + q_start.to(tl.int64) * stride_dot + head * stride_doh
        for start_m in range(lo, mid, BLOCK_M):
            if HAS_POS:
                if query_tile_visible(QPOS, q_start, q_len, start_m + offs_m_base, k_lo, k_hi, window, HAS_WINDOW):
                    dk_a, dk_b, dv = _dkdv_block(
                        dk_a, dk_b, dv, k_a, k_b, v, k_pos, n_valid, Q_base, DO_base, LSE, DELTA, QPOS, head,
                        stride_lse_h, q_start, start_m, q_len, window, stride_qt, stride_dot, sm_scale_log2,
                        offs_m_base, offs_a, offs_b, offs_v, True, IS_CAUSAL, HAS_POS, HAS_WINDOW,
                        HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V, DOT_PREC, UPCAST,
                    )
                    tiles += 1
            else:
                dk_a, dk_b, dv = _dkdv_block(
                    dk_a, dk_b, dv, k_a, k_b, v, k_pos, n_valid, Q_base, DO_base, LSE, DELTA, QPOS, head,
                    stride_lse_h, q_start, start_m, q_len, window, stride_qt, stride_dot, sm_scale_log2,
                    offs_m_base, offs_a, offs_b, offs_v, True, IS_CAUSAL, HAS_POS, HAS_WINDOW,
                    HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V, DOT_PREC, UPCAST,
                )
                tiles += 1
        for start_m in range(mid, full_hi, BLOCK_M):
            dk_a, dk_b, dv = _dkdv_block(
                dk_a, dk_b, dv, k_a, k_b, v, k_pos, n_valid, Q_base, DO_base, LSE, DELTA, QPOS, head,
                stride_lse_h, q_start, start_m, q_len, window, stride_qt, stride_dot, sm_scale_log2,
                offs_m_base, offs_a, offs_b, offs_v, False, IS_CAUSAL, HAS_POS, HAS_WINDOW,
                HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V, DOT_PREC, UPCAST,
            )
            tiles += 1
        for start_m in range(full_hi, q_end, BLOCK_M):
            if HAS_POS & HAS_WINDOW:
                if query_tile_visible(QPOS, q_start, q_len, start_m + offs_m_base, k_lo, k_hi, window, HAS_WINDOW):
                    dk_a, dk_b, dv = _dkdv_block(
                        dk_a, dk_b, dv, k_a, k_b, v, k_pos, n_valid, Q_base, DO_base, LSE, DELTA, QPOS, head,
                        stride_lse_h, q_start, start_m, q_len, window, stride_qt, stride_dot, sm_scale_log2,
                        offs_m_base, offs_a, offs_b, offs_v, True, IS_CAUSAL, HAS_POS, HAS_WINDOW,
                        HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V, DOT_PREC, UPCAST,
                    )
                    tiles += 1
            else:
                dk_a, dk_b, dv = _dkdv_block(
                    dk_a, dk_b, dv, k_a, k_b, v, k_pos, n_valid, Q_base, DO_base, LSE, DELTA, QPOS, head,
                    stride_lse_h, q_start, start_m, q_len, window, stride_qt, stride_dot, sm_scale_log2,
                    offs_m_base, offs_a, offs_b, offs_v, True, IS_CAUSAL, HAS_POS, HAS_WINDOW,
                    HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V, DOT_PREC, UPCAST,
                )
                tiles += 1
    if COUNT_TILES:
        tl.atomic_add(TILES + 1, tiles)

    DK_base = DK + split.to(tl.int64) * stride_dks + k_start.to(tl.int64) * stride_dkt + kv_head * stride_dkh
    DV_base = DV + split.to(tl.int64) * stride_dvs + k_start.to(tl.int64) * stride_dvt + kv_head * stride_dvh
    store_tile(DK_base, dk_a * sm_scale, offs_n, stride_dkt, offs_a, n_valid, ACCUMULATE, HEAD_A, BLOCK_A)
    if HEAD_B > 0:
        store_tile(DK_base + BLOCK_A, dk_b * sm_scale, offs_n, stride_dkt, offs_b, n_valid, ACCUMULATE, HEAD_B,
                   BLOCK_B)
    store_tile(DV_base, dv, offs_n, stride_dvt, offs_v, n_valid, ACCUMULATE, HEAD_V, BLOCK_V)


def _sum_partials(partials: torch.Tensor, accum: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Sum the [splits, ...] fp32 partials in slice order; add into ``accum`` when given."""
    total = partials.sum(0)
    return accum.add_(total) if accum is not None else total.to(dtype)


def triton_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    dq_accum: torch.Tensor | None = None,
    dk_accum: torch.Tensor | None = None,
    dv_accum: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) on the packed form; given fp32 accumulators are added into and returned."""
    check_device(q, k, v, do)
    q, k, v, do = (last_dim_contiguous(t) for t in (q, k, v, do))
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    total_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    num_docs = cu_seqlens_q.numel() - 1
    has_pos = bool(causal) and q_positions is not None
    q_pos = q_positions if has_pos else cu_seqlens_q
    k_pos = k_positions if has_pos else cu_seqlens_k
    if num_docs == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return tuple(
            acc if acc is not None else torch.zeros_like(like)
            for acc, like in ((dq_accum, q), (dk_accum, k), (dv_accum, v))
        )
    # Every row of every document is written exactly once by the kernels (gradient 0 where nothing
    # is visible), so fresh buffers need no memset. dk and dv share one kernel and so one mode: if
    # only one of them has an accumulator, the other accumulates into a zeroed fp32 scratch.
    accumulate_kv = dk_accum is not None or dv_accum is not None
    dq = dq_accum if dq_accum is not None else common.alloc_output(q.shape, q.dtype, q.device)
    tiles, counting = common.tile_counter(q.device)
    flags = dict(
        **qk_chunks(head_dim), HEAD_V=v.shape[-1], BLOCK_V=block_head_dim(v.shape[-1]), IS_CAUSAL=bool(causal),
        HAS_POS=has_pos, HAS_WINDOW=window is not None, COUNT_TILES=counting,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_16bit(q.dtype), SCAN=scan_block(),
    )
    group = heads_q // heads_kv
    splits = dkdv_head_splits(k.shape[0], num_docs, heads_kv, group, device_sms(q.device))
    if splits > 1:
        # fp32 partials, one per slice of query heads, summed below; the kernel writes every row.
        dk = common.alloc_output((splits, *k.shape), torch.float32, k.device)
        dv = common.alloc_output((splits, *v.shape), torch.float32, v.device)
    elif accumulate_kv:
        dk = dk_accum if dk_accum is not None else torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = dv_accum if dv_accum is not None else torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    else:
        dk = common.alloc_output(k.shape, k.dtype, k.device)
        dv = common.alloc_output(v.shape, v.dtype, v.device)
    # Strides of the 3-D [tokens, heads, d] view, plus the slice stride (0: one slice).
    dk_t, dv_t = (t[0] if splits > 1 else t for t in (dk, dv))
    split_strides = (dk.stride(0), dv.stride(0)) if splits > 1 else (0, 0)

    def grid_kv(meta):
        return (num_docs * heads_kv * splits, triton.cdiv(max_seqlen_k, meta["BLOCK_N"]))

    _flash_attn_bwd_dkdv_kernel[grid_kv](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk_t.stride(0), dk_t.stride(1), split_strides[0],
        dv_t.stride(0), dv_t.stride(1), split_strides[1], lse.stride(0),
        softmax_scale, softmax_scale * LOG2E, heads_kv, group, splits, window or 0, seq_bucket(max_seqlen_q),
        ACCUMULATE=accumulate_kv and splits == 1, **flags,
    )
    if splits > 1:
        dk, dv = _sum_partials(dk, dk_accum, k.dtype), _sum_partials(dv, dv_accum, v.dtype)
    elif accumulate_kv:
        dk = dk if dk_accum is not None else dk.to(k.dtype)
        dv = dv if dv_accum is not None else dv.to(v.dtype)

    def grid_q(meta):
        return (num_docs * heads_q, triton.cdiv(max_seqlen_q, meta["BLOCK_M"]))

    _flash_attn_bwd_dq_kernel[grid_q](
        q, k, v, do, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
        softmax_scale, softmax_scale * LOG2E, heads_q, heads_q // heads_kv, window or 0, seq_bucket(max_seqlen_k),
        ACCUMULATE=dq_accum is not None, **flags,
    )
    return dq, dk, dv
