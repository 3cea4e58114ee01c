"""Triton flash-attention forward: (out, lse) on the packed form, varlen, GQA, position masks.

One program owns BLOCK_M query rows of one (document, query head) and streams the document's key
blocks with the online softmax (exp2 domain, fp32 accumulators). Masking:

- non-causal: only the document's own keys (the last, partial key block is bounds-masked);
- causal without positions: key index <= query index inside the document; blocks left of the
  diagonal run without any mask, blocks right of it are never visited;
- causal with positions (a zig-zag ring step): key visible iff k_pos <= q_pos. The program
  first scans the document's key positions (vectorised, SCAN at a time) for two bounds: keys
  before the first k_pos > min(q_pos) run mask-free, keys after the last k_pos <= max(q_pos)
  are never read; blocks in between are masked, and skipped when their min k_pos exceeds the
  block's max q_pos. Correct for any positions; for zig-zag shards (positions ascending inside
  each document) the masked range is just the diagonal, so a step costs what a monolithic
  causal attention spends on the same tiles.

Rows that see no key end with l = 0: out = 0 and lse = -inf (the running max is clamped to 0 for
the exp so nothing turns into NaN).

Grid: axis 0 = document × query head (no 65535 limit), axis 1 = query blocks in reverse order so
the most expensive causal blocks start first (better tail balance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.attention import common
from xorl_kernels.attention.common import (
    INTERPRET,
    LN2,
    LOG2E,
    POS_HIGH,
    POS_LOW,
    block_head_dim,
    check_device,
    dot_precision,
    end_of_pos_at_most,
    first_pos_above,
    last_dim_contiguous,
    load_positions,
    load_tile,
    scan_block,
    seq_bucket,
    store_tile,
    upcast_16bit,
)


def _configs() -> list[triton.Config]:
    if INTERPRET:
        # The interpreter runs numpy per program: one small config, no tuning. BLOCK_M != BLOCK_N on
        # purpose so the tests exercise unequal tiles.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    shapes = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 8, 2),
              (128, 64, 8, 4), (128, 128, 4, 2), (64, 64, 4, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@triton.jit
def _fwd_block(
    acc, l_i, m_i, q, q_pos, K_base, V_base, k_start, start_n, k_len, k_pos_ptr,
    stride_kt, stride_vt, sm_scale_log2, offs_n, offs_d,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key block of the online softmax. MASKED adds the bounds and causal masks."""
    cols = start_n + offs_n
    n_valid = cols < k_len
    k = load_tile(K_base, cols, stride_kt, offs_d, n_valid, HEAD_DIM, BLOCK_D, UPCAST)
    v = load_tile(V_base, cols, stride_vt, offs_d, n_valid, HEAD_DIM, BLOCK_D, UPCAST)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
    if MASKED:
        visible = n_valid[None, :]
        if IS_CAUSAL:
            k_pos = load_positions(k_pos_ptr, k_start, cols, n_valid, HAS_POS)
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing visible so far keeps m = -inf; exponentiate against 0 instead (no NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.autotune(configs=_configs(), key=["seq_bucket", "HEAD_DIM", "IS_CAUSAL", "HAS_POS", "DOT_PREC"])
@triton.jit
def _flash_attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, QPOS, KPOS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    sm_scale_log2, heads_q, group, seq_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SCAN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    Q_base = Q + q_start.to(tl.int64) * stride_qt + head * stride_qh
    K_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    q = load_tile(Q_base, offs_m, stride_qt, offs_d, m_valid, HEAD_DIM, BLOCK_D, UPCAST)
    q_pos = load_positions(QPOS, q_start, offs_m, m_valid, HAS_POS)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Key range [0, full_end) is visible to every row (no mask); [full_end, end) needs the mask;
    # keys past end are visible to no row of this block and are never read.
    if IS_CAUSAL:
        if HAS_POS:
            q_lo = tl.min(tl.where(m_valid, q_pos, POS_HIGH))
            q_hi = tl.max(tl.where(m_valid, q_pos, POS_LOW))
            full_end = (first_pos_above(KPOS, k_start, k_len, q_lo, SCAN) // BLOCK_N) * BLOCK_N
            end = end_of_pos_at_most(KPOS, k_start, k_len, q_hi, SCAN)
        else:
            full_end = (tl.minimum(pid_m * BLOCK_M + 1, k_len) // BLOCK_N) * BLOCK_N
            end = tl.minimum(k_len, tl.minimum(q_len, (pid_m + 1) * BLOCK_M))
    else:
        full_end = (k_len // BLOCK_N) * BLOCK_N
        end = k_len
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS,
            stride_kt, stride_vt, sm_scale_log2, offs_n, offs_d,
            False, IS_CAUSAL, HAS_POS, HEAD_DIM, BLOCK_D, DOT_PREC, UPCAST,
        )
    for start_n in range(full_end, end, BLOCK_N):
        if HAS_POS:
            # Arbitrary positions: a block in the masked range may still be fully masked; skip it.
            # (Zig-zag shards keep positions sorted per document, so this range is the diagonal.)
            cols = start_n + offs_n
            k_lo = tl.min(tl.where(cols < k_len, load_positions(KPOS, k_start, cols, cols < k_len, True), POS_HIGH))
            if k_lo <= q_hi:
                acc, l_i, m_i = _fwd_block(
                    acc, l_i, m_i, q, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS,
                    stride_kt, stride_vt, sm_scale_log2, offs_n, offs_d,
                    True, IS_CAUSAL, HAS_POS, HEAD_DIM, BLOCK_D, DOT_PREC, UPCAST,
                )
        else:
            acc, l_i, m_i = _fwd_block(
                acc, l_i, m_i, q, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS,
                stride_kt, stride_vt, sm_scale_log2, offs_n, offs_d,
                True, IS_CAUSAL, HAS_POS, HEAD_DIM, BLOCK_D, DOT_PREC, UPCAST,
            )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    O_base = O + q_start.to(tl.int64) * stride_ot + head * stride_oh
    store_tile(O_base, out, offs_m, stride_ot, offs_d, m_valid, False, HEAD_DIM, BLOCK_D)
    tl.store(LSE + head.to(tl.int64) * stride_lse_h + q_start + offs_m, lse, mask=m_valid)


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [total_q, heads_q, d] in q.dtype, lse fp32 [heads_q, total_q]) on the packed form."""
    if sinks is not None or window is not None or v.shape[-1] != q.shape[-1]:
        raise NotImplementedError("Triton attention: sinks / window / head_dim_v != head_dim_qk not yet; use backend='reference'")
    check_device(q, k, v)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    total_q, heads_q, head_dim = q.shape
    out = common.alloc_output(q.shape, q.dtype, q.device)
    lse = common.alloc_output((heads_q, total_q), torch.float32, q.device)
    num_docs = cu_seqlens_q.numel() - 1
    if total_q == 0 or num_docs == 0 or max_seqlen_q == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    has_pos = bool(causal) and q_positions is not None
    q_pos = q_positions if has_pos else cu_seqlens_q  # any int pointer when unused
    k_pos = k_positions if has_pos else cu_seqlens_k

    def grid(meta):
        return (num_docs * heads_q, triton.cdiv(max_seqlen_q, meta["BLOCK_M"]))

    _flash_attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        softmax_scale * LOG2E, heads_q, heads_q // k.shape[1], seq_bucket(max_seqlen_k),
        HEAD_DIM=head_dim, BLOCK_D=block_head_dim(head_dim), IS_CAUSAL=bool(causal), HAS_POS=has_pos,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_16bit(q.dtype), SCAN=scan_block(),
    )
    return out, lse
