"""Triton flash-attention backward, the dQ kernel (see attention/bwd_triton.py for the whole backward).

One program per (document, query head, query block) loops over the visible key blocks, with the
forward's loop bounds (attention/bounds.py key_range): dQ = scale·dS·K in fp32, dS = P ∘ (dP - delta).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xorl_kernels.attention.bounds import key_range, key_tile_visible
from xorl_kernels.attention.common import INTERPRET, load_positions, load_tile, store_tile


def bwd_configs(block_a: str, block_b: str) -> list[triton.Config]:
    """block_a: the block a program owns; block_b: the block it loops over."""
    if INTERPRET:
        return [triton.Config({block_a: 32, block_b: 16}, num_warps=4, num_stages=1)]
    shapes = [(64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2)]
    return [triton.Config({block_a: a, block_b: b}, num_warps=w, num_stages=s) for a, b, w, s in shapes]


def restore_on_tuning(names):
    # With ACCUMULATE the kernels add into caller buffers: tuning runs must not add repeatedly.
    return None if INTERPRET else names


@triton.jit
def load_row_stats(LSE, DELTA, head, stride_lse_h, q_start, offs_m, m_valid):
    """lse in the exp2 domain (with -inf rows mapped to 0) and delta for a query block."""
    row = head.to(tl.int64) * stride_lse_h + q_start + offs_m
    lse = tl.load(LSE + row, mask=m_valid, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + row, mask=m_valid, other=0.0)
    return lse, delta


@triton.jit
def _dq_block(
    dq_a, dq_b, q_a, q_b, do, lse, delta, q_pos, m_valid, K_base, V_base, KPOS, k_start, start_n, k_len,
    window, stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_A: tl.constexpr, BLOCK_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_B: tl.constexpr,
    HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    cols = start_n + offs_n
    n_valid = cols < k_len
    k_a = load_tile(K_base, cols, stride_kt, offs_a, n_valid, HEAD_A, BLOCK_A, UPCAST)
    v = load_tile(V_base, cols, stride_vt, offs_v, n_valid, HEAD_V, BLOCK_V, UPCAST)
    qk = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PREC)
    k_b = k_a
    if HEAD_B > 0:
        k_b = load_tile(K_base + BLOCK_A, cols, stride_kt, offs_b, n_valid, HEAD_B, BLOCK_B, UPCAST)
        qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision=DOT_PREC)
    qk = qk * sm_scale_log2
    if MASKED:
        visible = n_valid[None, :] & m_valid[:, None]
        if IS_CAUSAL:
            k_pos = load_positions(KPOS, k_start, cols, n_valid, HAS_POS)
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    p = tl.math.exp2(qk - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = (p * (dp - delta[:, None])).to(k_a.dtype)
    dq_a = tl.dot(ds, k_a, dq_a, input_precision=DOT_PREC)
    if HEAD_B > 0:
        dq_b = tl.dot(ds, k_b, dq_b, input_precision=DOT_PREC)
    return dq_a, dq_b


@triton.autotune(
    configs=bwd_configs("BLOCK_M", "BLOCK_N"),
    key=["seq_bucket", "HEAD_A", "HEAD_B", "HEAD_V", "IS_CAUSAL", "HAS_POS", "HAS_WINDOW", "DOT_PREC",
         "ACCUMULATE"],
    restore_value=restore_on_tuning(["DQ", "TILES"]),
)
@triton.jit
def _flash_attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, QPOS, KPOS, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse_h,
    sm_scale, sm_scale_log2, heads_q, group, window, seq_bucket,
    HEAD_A: tl.constexpr, BLOCK_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_B: tl.constexpr,
    HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, COUNT_TILES: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_dh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    doc = pid_dh // heads_q
    head = pid_dh % heads_q
    q_start = tl.load(CU_Q + doc)
    q_len = tl.load(CU_Q + doc + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    k_start = tl.load(CU_K + doc)
    k_len = tl.load(CU_K + doc + 1) - k_start
    kv_head = head // group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, BLOCK_A)
    offs_b = tl.arange(0, BLOCK_B)
    offs_v = tl.arange(0, BLOCK_V)
    m_valid = offs_m < q_len
    Q_base = Q + q_start.to(tl.int64) * stride_qt + head * stride_qh
    DO_base = DO + q_start.to(tl.int64) * stride_dot + head * stride_doh
    K_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    q_a = load_tile(Q_base, offs_m, stride_qt, offs_a, m_valid, HEAD_A, BLOCK_A, UPCAST)
    q_b = q_a
    if HEAD_B > 0:
        q_b = load_tile(Q_base + BLOCK_A, offs_m, stride_qt, offs_b, m_valid, HEAD_B, BLOCK_B, UPCAST)
    do = load_tile(DO_base, offs_m, stride_dot, offs_v, m_valid, HEAD_V, BLOCK_V, UPCAST)
    lse, delta = load_row_stats(LSE, DELTA, head, stride_lse_h, q_start, offs_m, m_valid)
    q_pos = load_positions(QPOS, q_start, offs_m, m_valid, HAS_POS)
    dq_a = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    dq_b = tl.zeros([BLOCK_M, BLOCK_B], dtype=tl.float32)

    # Loop bounds exactly as in the forward (bounds.key_range).
    lo, f0, f1, end, q_lo, q_hi = key_range(
        KPOS, k_start, k_len, q_pos, m_valid, pid_m * BLOCK_M, q_len, window,
        IS_CAUSAL, HAS_POS, HAS_WINDOW, SCAN, BLOCK_M, BLOCK_N,
    )
    tiles = q_len * 0
    # Padded query rows (past q_len) produce garbage only in rows that are never stored.
    if HAS_WINDOW:  # the window's leading masked edge (without one, lo = f0 = 0)
        for start_n in range(lo, tl.minimum(f0, end), BLOCK_N):
            if HAS_POS:
                if key_tile_visible(KPOS, k_start, k_len, start_n + offs_n, q_lo, q_hi, window, HAS_WINDOW):
                    dq_a, dq_b = _dq_block(
                        dq_a, dq_b, q_a, q_b, do, lse, delta, q_pos, m_valid, K_base, V_base, KPOS, k_start, start_n,
                        k_len, window, stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                        True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                        DOT_PREC, UPCAST,
                    )
                    tiles += 1
            else:
                dq_a, dq_b = _dq_block(
                    dq_a, dq_b, q_a, q_b, do, lse, delta, q_pos, m_valid, K_base, V_base, KPOS, k_start, start_n,
                    k_len, window, stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                    True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                    DOT_PREC, UPCAST,
                )
                tiles += 1
    for start_n in range(f0, f1, BLOCK_N):
        dq_a, dq_b = _dq_block(
            dq_a, dq_b, q_a, q_b, do, lse, delta, q_pos, m_valid, K_base, V_base, KPOS, k_start, start_n,
            k_len, window, stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
            False, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
            DOT_PREC, UPCAST,
        )
        tiles += 1
    for start_n in range(f1, end, BLOCK_N):
        if HAS_POS:
            if key_tile_visible(KPOS, k_start, k_len, start_n + offs_n, q_lo, q_hi, window, HAS_WINDOW):
                dq_a, dq_b = _dq_block(
                    dq_a, dq_b, q_a, q_b, do, lse, delta, q_pos, m_valid, K_base, V_base, KPOS, k_start, start_n,
                    k_len, window, stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                    True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                    DOT_PREC, UPCAST,
                )
                tiles += 1
        else:
            dq_a, dq_b = _dq_block(
                dq_a, dq_b, q_a, q_b, do, lse, delta, q_pos, m_valid, K_base, V_base, KPOS, k_start, start_n,
                k_len, window, stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                DOT_PREC, UPCAST,
            )
            tiles += 1
    if COUNT_TILES:
        tl.atomic_add(TILES + 2, tiles)

    DQ_base = DQ + q_start.to(tl.int64) * stride_dqt + head * stride_dqh
    store_tile(DQ_base, dq_a * sm_scale, offs_m, stride_dqt, offs_a, m_valid, ACCUMULATE, HEAD_A, BLOCK_A)
    if HEAD_B > 0:
        store_tile(DQ_base + BLOCK_A, dq_b * sm_scale, offs_m, stride_dqt, offs_b, m_valid, ACCUMULATE, HEAD_B,
                   BLOCK_B)
