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
- sliding window W (causal): also k_pos > q_pos - W. Two more scans give a lower bound (keys
  before the first k_pos > min(q_pos) - W are never read) and shrink the mask-free range to keys
  with k_pos > max(q_pos) - W, so a windowed attention visits about S·W/(BLOCK_M·BLOCK_N) tiles
  (attention/bounds.py; tests/unit/kernels/test_attention_features.py audits the count).

Head dims: q·k and v are tiled separately (common.qk_chunks): v one power-of-two chunk, q·k one
chunk or two (192 = 128 + 64 for MLA, summed dots) so no q·k FLOPs go to padding.

Sinks (gpt-oss): after the last key block each row folds exp(sink) into its denominator (exp2
domain), so lse includes the sink. Rows that see no key end with l = 0: out = 0 and lse = -inf
(the running max is clamped to 0 for the exp so nothing turns into NaN); with a sink, out = 0 and
lse = sink.

Grid: axis 0 = document × query head (no 65535 limit), axis 1 = query blocks in reverse order so
the most expensive causal blocks start first (better tail balance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.attention import common
from xorl_kernels.attention.bounds import key_range, key_tile_visible
from xorl_kernels.attention.common import (
    INTERPRET,
    LN2,
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
    acc, l_i, m_i, q_a, q_b, q_pos, K_base, V_base, k_start, start_n, k_len, k_pos_ptr, window,
    stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_A: tl.constexpr, BLOCK_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_B: tl.constexpr,
    HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key block of the online softmax. MASKED adds the bounds, causal and window masks."""
    cols = start_n + offs_n
    n_valid = cols < k_len
    k_a = load_tile(K_base, cols, stride_kt, offs_a, n_valid, HEAD_A, BLOCK_A, UPCAST)
    v = load_tile(V_base, cols, stride_vt, offs_v, n_valid, HEAD_V, BLOCK_V, UPCAST)
    qk = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PREC)
    if HEAD_B > 0:
        k_b = load_tile(K_base + BLOCK_A, cols, stride_kt, offs_b, n_valid, HEAD_B, BLOCK_B, UPCAST)
        qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision=DOT_PREC)
    qk = qk * sm_scale_log2
    if MASKED:
        visible = n_valid[None, :]
        if IS_CAUSAL:
            k_pos = load_positions(k_pos_ptr, k_start, cols, n_valid, HAS_POS)
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
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


@triton.autotune(
    configs=_configs(),
    key=["seq_bucket", "HEAD_A", "HEAD_B", "HEAD_V", "IS_CAUSAL", "HAS_POS", "HAS_WINDOW", "DOT_PREC"],
    restore_value=None if INTERPRET else ["TILES"],
)
@triton.jit
def _flash_attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, QPOS, KPOS, SINKS, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    sm_scale_log2, heads_q, group, window, seq_bucket,
    HEAD_A: tl.constexpr, BLOCK_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_B: tl.constexpr,
    HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, COUNT_TILES: tl.constexpr,
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
    offs_a = tl.arange(0, BLOCK_A)
    offs_b = tl.arange(0, BLOCK_B)
    offs_v = tl.arange(0, BLOCK_V)
    m_valid = offs_m < q_len
    Q_base = Q + q_start.to(tl.int64) * stride_qt + head * stride_qh
    K_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    q_a = load_tile(Q_base, offs_m, stride_qt, offs_a, m_valid, HEAD_A, BLOCK_A, UPCAST)
    q_b = q_a  # unused unless the q·k head dim has a second chunk
    if HEAD_B > 0:
        q_b = load_tile(Q_base + BLOCK_A, offs_m, stride_qt, offs_b, m_valid, HEAD_B, BLOCK_B, UPCAST)
    q_pos = load_positions(QPOS, q_start, offs_m, m_valid, HAS_POS)

    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Keys [f0, f1) are visible to every row (no mask); [lo, f0) and [f1, end) need the mask;
    # keys outside [lo, end) are visible to no row of this block and are never read.
    lo, f0, f1, end, q_lo, q_hi = key_range(
        KPOS, k_start, k_len, q_pos, m_valid, pid_m * BLOCK_M, q_len, window,
        IS_CAUSAL, HAS_POS, HAS_WINDOW, SCAN, BLOCK_M, BLOCK_N,
    )
    tiles = q_len * 0
    if HAS_WINDOW:  # the window's leading masked edge (without one, lo = f0 = 0)
        for start_n in range(lo, tl.minimum(f0, end), BLOCK_N):
            # Arbitrary positions: a block in a masked range may still be fully masked; skip it.
            # (Zig-zag shards keep positions sorted per document, so these ranges are the band edges.)
            if HAS_POS:
                if key_tile_visible(KPOS, k_start, k_len, start_n + offs_n, q_lo, q_hi, window, HAS_WINDOW):
                    acc, l_i, m_i = _fwd_block(
                        acc, l_i, m_i, q_a, q_b, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS, window,
                        stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                        True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                        DOT_PREC, UPCAST,
                    )
                    tiles += 1
            else:
                acc, l_i, m_i = _fwd_block(
                    acc, l_i, m_i, q_a, q_b, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS, window,
                    stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                    True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                    DOT_PREC, UPCAST,
                )
                tiles += 1
    for start_n in range(f0, f1, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q_a, q_b, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS, window,
            stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
            False, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
            DOT_PREC, UPCAST,
        )
        tiles += 1
    for start_n in range(f1, end, BLOCK_N):
        if HAS_POS:
            if key_tile_visible(KPOS, k_start, k_len, start_n + offs_n, q_lo, q_hi, window, HAS_WINDOW):
                acc, l_i, m_i = _fwd_block(
                    acc, l_i, m_i, q_a, q_b, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS, window,
                    stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                    True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                    DOT_PREC, UPCAST,
                )
                tiles += 1
        else:
            acc, l_i, m_i = _fwd_block(
                acc, l_i, m_i, q_a, q_b, q_pos, K_base, V_base, k_start, start_n, k_len, KPOS, window,
                stride_kt, stride_vt, sm_scale_log2, offs_n, offs_a, offs_b, offs_v,
                True, IS_CAUSAL, HAS_POS, HAS_WINDOW, HEAD_A, BLOCK_A, HEAD_B, BLOCK_B, HEAD_V, BLOCK_V,
                DOT_PREC, UPCAST,
            )
            tiles += 1
    if COUNT_TILES:
        tl.atomic_add(TILES, tiles)

    if HAS_SINKS:
        # The sink joins the denominator as one more logit (exp2 domain, pre-scaled by log2 e).
        sink = tl.load(SINKS + head)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)  # 0 for rows that saw no key (m_i = -inf)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    O_base = O + q_start.to(tl.int64) * stride_ot + head * stride_oh
    store_tile(O_base, out, offs_m, stride_ot, offs_v, m_valid, False, HEAD_V, BLOCK_V)
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
    """(out [total_q, heads_q, d_v] in q.dtype, lse fp32 [heads_q, total_q]) on the packed form."""
    check_device(q, k, v)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    total_q, heads_q, head_dim = q.shape
    head_dim_v = v.shape[-1]
    out = common.alloc_output((total_q, heads_q, head_dim_v), q.dtype, q.device)
    lse = common.alloc_output((heads_q, total_q), torch.float32, q.device)
    num_docs = cu_seqlens_q.numel() - 1
    if total_q == 0 or num_docs == 0 or max_seqlen_q == 0:
        out.zero_()
        return out, (lse.fill_(float("-inf")) if sinks is None else lse.copy_(sinks.float()[:, None].expand_as(lse)))
    has_pos = bool(causal) and q_positions is not None
    q_pos = q_positions if has_pos else cu_seqlens_q  # any int pointer when unused
    k_pos = k_positions if has_pos else cu_seqlens_k
    # Sinks in the kernel's exp2 domain (a [heads] op, no sync); any float pointer when unused.
    sinks_log2 = sinks.float() * LOG2E if sinks is not None else lse
    tiles, counting = common.tile_counter(q.device)

    def grid(meta):
        return (num_docs * heads_q, triton.cdiv(max_seqlen_q, meta["BLOCK_M"]))

    _flash_attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, sinks_log2, tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        softmax_scale * LOG2E, heads_q, heads_q // k.shape[1], window or 0, seq_bucket(max_seqlen_k),
        **qk_chunks(head_dim), HEAD_V=head_dim_v, BLOCK_V=block_head_dim(head_dim_v),
        IS_CAUSAL=bool(causal), HAS_POS=has_pos, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        COUNT_TILES=counting, DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_16bit(q.dtype), SCAN=scan_block(),
    )
    return out, lse
