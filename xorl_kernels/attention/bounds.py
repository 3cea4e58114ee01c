"""Loop bounds of the Triton flash-attention kernels, derived from positions (jit helpers).

A program owns one query block (forward, dQ) or one key block (dK/dV) and loops over the other
side. These helpers give the range it must visit, split into tiles that need the mask and tiles
visible to every row (mask-free); anything outside is never read. Causal masks and sliding
windows both come from positions (or indices inside the document when there are none), so the
bounds are tight when positions ascend inside each document (zig-zag shards do): a windowed
attention then visits only the tiles that meet the band p - W < k <= p. Without a window any
positions are correct (bounds by scans over the document); with one, positions must be
non-decreasing inside each document (bounds by searches, O(log) not O(document) per program).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xorl_kernels.attention.common import POS_HIGH, POS_LOW, load_positions


@triton.jit
def first_pos_above(POS, start, length, threshold, SCAN: tl.constexpr):
    """Smallest i in [0, length) with POS[start + i] > threshold, or length if there is none.

    With it a block's loop bounds come from positions: every key before the first key with
    k_pos > min(q_pos) is visible to every query row (mask-free tiles), whatever the positions.
    """
    result = length
    for s in range(0, length, SCAN):
        idx = s + tl.arange(0, SCAN)
        pos = tl.load(POS + start + idx, mask=idx < length, other=POS_LOW)
        result = tl.minimum(result, tl.min(tl.where(pos > threshold, idx, length)))
    return result


@triton.jit
def end_of_pos_at_most(POS, start, length, threshold, SCAN: tl.constexpr):
    """1 + the largest i in [0, length) with POS[start + i] <= threshold, or 0 if there is none."""
    result = length * 0
    for s in range(0, length, SCAN):
        idx = s + tl.arange(0, SCAN)
        pos = tl.load(POS + start + idx, mask=idx < length, other=POS_HIGH)
        result = tl.maximum(result, tl.max(tl.where(pos <= threshold, idx + 1, 0)))
    return result


@triton.jit
def sorted_count_at_most(POS, start, length, threshold, SCAN: tl.constexpr):
    """How many i in [0, length) have POS[start + i] <= threshold, for positions non-decreasing over
    the range (so also the first i with POS > threshold). A SCAN-ary search: each step reads SCAN
    evenly spaced positions and narrows the range SCAN-fold, so a bound costs about
    log_SCAN(length) dependent loads (2-3 on a GPU) instead of a scan of the whole document; with a
    window the compute per query block is O(W), and whole-document scans would dominate it.
    """
    lo = length * 0
    hi = length
    while lo < hi:  # invariant: the answer lies in [lo, hi]; each step leaves at most stride - 1
        stride = tl.cdiv(hi - lo, SCAN)
        idx = lo + tl.arange(0, SCAN) * stride
        valid = idx < hi
        pos = tl.load(POS + start + idx, mask=valid, other=POS_HIGH)
        n = tl.sum(((pos <= threshold) & valid).to(tl.int32))  # samples 0..n-1 are <= threshold
        new_lo = tl.where(n > 0, lo + (n - 1) * stride + 1, lo)
        hi = tl.minimum(hi, lo + n * stride)  # sample n (if any) is > threshold
        lo = new_lo
    return lo


@triton.jit
def key_range(
    KPOS, k_start, k_len, q_pos, m_valid, m_start, q_len, window,
    IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Key loop bounds of one query block (forward and dQ): ``(lo, f0, f1, end, q_lo, q_hi)``.

    Keys [lo, f0) and [f1, end) need the mask, [f0, f1) are visible to every row (mask-free),
    keys outside [lo, end) are visible to no row and never read. Causal: keys after the last
    k_pos <= max(q_pos) are skipped, keys up to the first k_pos > min(q_pos) are mask-free. A
    window W adds: keys before the first k_pos > min(q_pos) - W are skipped, and mask-free keys
    also need k_pos > max(q_pos) - W. From the positions: without a window by scans, correct for
    any positions (tight when they ascend inside each document, as zig-zag shards do); with a
    window by searches, which need positions non-decreasing inside each document (layout.py checks
    CPU tensors). Without positions, from the indices. q_lo / q_hi: the block's smallest / largest
    query position (for per-tile skips).
    """
    lo = k_len * 0
    f0 = k_len * 0
    q_lo = m_start
    q_hi = tl.minimum(q_len, m_start + BLOCK_M) - 1
    if IS_CAUSAL:
        if HAS_POS:
            q_lo = tl.min(tl.where(m_valid, q_pos, POS_HIGH))
            q_hi = tl.max(tl.where(m_valid, q_pos, POS_LOW))
            if HAS_WINDOW:
                full_end = (sorted_count_at_most(KPOS, k_start, k_len, q_lo, SCAN) // BLOCK_N) * BLOCK_N
                end = sorted_count_at_most(KPOS, k_start, k_len, q_hi, SCAN)
                lo = (sorted_count_at_most(KPOS, k_start, k_len, q_lo - window, SCAN) // BLOCK_N) * BLOCK_N
                inside_all = sorted_count_at_most(KPOS, k_start, k_len, q_hi - window, SCAN)
                f0 = tl.maximum(tl.cdiv(inside_all, BLOCK_N) * BLOCK_N, lo)
            else:
                full_end = (first_pos_above(KPOS, k_start, k_len, q_lo, SCAN) // BLOCK_N) * BLOCK_N
                end = end_of_pos_at_most(KPOS, k_start, k_len, q_hi, SCAN)
        else:
            full_end = (tl.minimum(m_start + 1, k_len) // BLOCK_N) * BLOCK_N
            end = tl.minimum(k_len, q_hi + 1)
            if HAS_WINDOW:
                lo = (tl.maximum(q_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
                inside_all = tl.minimum(tl.maximum(q_hi - window + 1, 0), k_len)
                f0 = tl.maximum(tl.cdiv(inside_all, BLOCK_N) * BLOCK_N, lo)
    else:
        full_end = (k_len // BLOCK_N) * BLOCK_N
        end = k_len
    f1 = tl.maximum(full_end, f0)
    return lo, f0, f1, end, q_lo, q_hi


@triton.jit
def key_tile_visible(KPOS, k_start, k_len, cols, q_lo, q_hi, window, HAS_WINDOW: tl.constexpr):
    """Whether a masked key tile (arbitrary positions) has a key some row of the block can see."""
    valid = cols < k_len
    k_pos = load_positions(KPOS, k_start, cols, valid, True)
    visible = tl.min(tl.where(valid, k_pos, POS_HIGH)) <= q_hi
    if HAS_WINDOW:
        visible = visible & (tl.max(tl.where(valid, k_pos, POS_LOW)) > q_lo - window)
    return visible


@triton.jit
def query_range(
    QPOS, q_start, q_len, k_pos, n_valid, n_start, k_len, window,
    IS_CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Query loop bounds of one key block (dK/dV): ``(lo, mid, full_hi, q_end, k_lo, k_hi)``.

    Rows [lo, mid) and [full_hi, q_end) need the mask, [mid, full_hi) see every key of the block
    (mask-free), rows outside [lo, q_end) see none of it. Causal: rows before the first q_pos >=
    min(k_pos) are skipped, rows after the last q_pos < max(k_pos) are mask-free. A window W adds:
    rows after the last q_pos <= max(k_pos) + W - 1 are skipped, and mask-free rows also need
    q_pos <= min(k_pos) + W - 1. Mirrors key_range (scans for any positions without a window,
    searches over non-decreasing positions with one).
    """
    k_lo = n_start
    k_hi = tl.minimum(n_start + BLOCK_N, k_len) - 1
    q_end = q_len
    if IS_CAUSAL:
        if HAS_POS:
            k_lo = tl.min(tl.where(n_valid, k_pos, POS_HIGH))
            k_hi = tl.max(tl.where(n_valid, k_pos, POS_LOW))
            if HAS_WINDOW:
                lo = (sorted_count_at_most(QPOS, q_start, q_len, k_lo - 1, SCAN) // BLOCK_M) * BLOCK_M
                mid = tl.cdiv(sorted_count_at_most(QPOS, q_start, q_len, k_hi - 1, SCAN), BLOCK_M) * BLOCK_M
            else:
                lo = (first_pos_above(QPOS, q_start, q_len, k_lo - 1, SCAN) // BLOCK_M) * BLOCK_M
                mid = tl.cdiv(end_of_pos_at_most(QPOS, q_start, q_len, k_hi - 1, SCAN), BLOCK_M) * BLOCK_M
        else:
            lo = (n_start // BLOCK_M) * BLOCK_M
            mid = tl.cdiv(n_start + BLOCK_N, BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), q_len)
    else:
        lo = q_len * 0
        mid = q_len * 0
    # Mask-free tiles also need every key of this block in bounds.
    full_hi = tl.where(n_start + BLOCK_N <= k_len, tl.maximum((q_len // BLOCK_M) * BLOCK_M, mid), mid)
    if IS_CAUSAL:
        if HAS_WINDOW:
            if HAS_POS:
                stop = sorted_count_at_most(QPOS, q_start, q_len, k_hi + window - 1, SCAN)
                free_stop = sorted_count_at_most(QPOS, q_start, q_len, k_lo + window - 1, SCAN)
            else:
                stop = tl.minimum(tl.maximum(k_hi + window, 0), q_len)
                free_stop = tl.minimum(tl.maximum(k_lo + window, 0), q_len)
            q_end = tl.minimum(tl.cdiv(stop, BLOCK_M) * BLOCK_M, q_len)
            mid = tl.minimum(mid, q_end)
            full_hi = tl.maximum(tl.minimum(full_hi, (free_stop // BLOCK_M) * BLOCK_M), mid)
    return lo, mid, full_hi, q_end, k_lo, k_hi


@triton.jit
def query_tile_visible(QPOS, q_start, q_len, rows, k_lo, k_hi, window, HAS_WINDOW: tl.constexpr):
    """Whether a masked query tile (arbitrary positions) has a row that sees some key of the block."""
    valid = rows < q_len
    q_pos = load_positions(QPOS, q_start, rows, valid, True)
    visible = tl.max(tl.where(valid, q_pos, POS_LOW)) >= k_lo
    if HAS_WINDOW:
        visible = visible & (tl.min(tl.where(valid, q_pos, POS_HIGH)) < k_hi + window)
    return visible
