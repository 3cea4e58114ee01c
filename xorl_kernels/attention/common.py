"""Pieces shared by the Triton flash-attention forward and backward kernels.

Both kernels work on the packed form (see attention/reference.py): q [total_q, heads_q, d],
k/v [total_k, heads_kv, d], lse/delta fp32 [heads_q, total_q], documents given by cu_seqlens.
Only the last dimension must be contiguous; token and head strides are passed in.

Only APIs present in Triton 3.6 are used here (plain pointer arithmetic, no TMA descriptors,
no block pointers), so the same code runs on the GPU image (3.6) and the dev image (3.9).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting

# Read once: the interpreter must be chosen before triton is imported anyway.
INTERPRET = triton_interpreting()
LOG2E = 1.4426950408889634
# Constants read inside kernels must be tl.constexpr.
LN2 = tl.constexpr(0.6931471805599453)
# Sentinels for min/max over padded rows; positions are int32 strictly inside (-2**31, 2**31 - 1).
POS_LOW = tl.constexpr(-2147483647)
POS_HIGH = tl.constexpr(2147483647)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently run in tf32 (the fp32 tolerance is 1e-5); ignored for 16-bit.
    return "ieee" if dtype == torch.float32 else "tf32"


def block_head_dim(head_dim: int) -> int:
    """Padded head dim: tl.arange needs a power of two and tl.dot at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def qk_chunks(head_dim: int) -> dict[str, int]:
    """How the q·k head dim is tiled: one padded power-of-two chunk, or two when that is narrower.

    tl.arange needs power-of-two widths, so a 192-wide q·k (MLA) padded to one 256-wide tile
    would spend a third of its q·k FLOPs and loads on zeros; instead it runs as a 128-wide and a
    64-wide chunk (two dots summed, two dK/dQ accumulators), with no padding at all. 96 -> 64+32,
    80 -> 64+16; 24 stays one 32-wide chunk (16+16 is no narrower). The value head dim is one
    chunk padded to a power of two (block_head_dim): its only products are P·V and dO·Vᵀ, and the
    MLA value dim (128) is already a power of two. Keys: HEAD_A / BLOCK_A (columns and width of
    chunk A), HEAD_B / BLOCK_B (chunk B; HEAD_B = 0 means no second chunk, BLOCK_B then only
    sizes an unused dummy).
    """
    full = block_head_dim(head_dim)
    low = 1 << (head_dim.bit_length() - 1)  # largest power of two <= head_dim
    rest = head_dim - low
    if low >= 16 and rest > 0 and low + block_head_dim(rest) < full:
        return dict(HEAD_A=low, BLOCK_A=low, HEAD_B=rest, BLOCK_B=block_head_dim(rest))
    return dict(HEAD_A=head_dim, BLOCK_A=full, HEAD_B=0, BLOCK_B=16)


def seq_bucket(max_seqlen: int) -> int:
    """Autotune key: configs are re-tuned per power-of-two bucket of the longest document, not per length."""
    return triton.next_power_of_2(max(int(max_seqlen), 16))


def check_device(*tensors: torch.Tensor) -> None:
    if not INTERPRET and not all(t.is_cuda for t in tensors):
        raise RuntimeError(
            "the Triton flash-attention backend needs CUDA tensors; on CPU set TRITON_INTERPRET=1 "
            "before importing triton, or use backend='reference'"
        )


def alloc_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised kernel output; tests replace this to hand kernels NaN-poisoned buffers."""
    return torch.empty(shape, dtype=dtype, device=device)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def upcast_16bit(dtype: torch.dtype) -> bool:
    """The Triton interpreter (3.9, numpy 2) computes bf16/fp16 dots and products on raw bits:
    garbage. Under the interpreter, 16-bit tiles are widened to fp32 right after loading (results
    are still stored in 16 bits). Compiled kernels keep 16-bit dot operands."""
    return INTERPRET and dtype in (torch.float16, torch.bfloat16)


@triton.jit
def load_tile(
    base, offs_rows, stride_row, offs_d, rows_valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[rows, BLOCK_D] tile; padded rows / head-dim columns read as 0 (which keeps every dot exact)."""
    ptrs = base + offs_rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        mask = rows_valid[:, None]
    else:
        mask = rows_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def store_tile(
    base, value, offs_rows, stride_row, offs_d, rows_valid, ACCUMULATE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Write (or, with ACCUMULATE, add into) a [rows, BLOCK_D] tile, casting to the buffer's dtype."""
    ptrs = base + offs_rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        mask = rows_valid[:, None]
    else:
        mask = rows_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    if ACCUMULATE:
        value += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def load_positions(POS, doc_start, offs, valid, HAS_POS: tl.constexpr):
    """Per-token positions of a block; without a positions tensor, the index inside the document."""
    if HAS_POS:
        pos = tl.load(POS + doc_start + offs, mask=valid, other=0)
    else:
        pos = offs
    return pos


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
    also need k_pos > max(q_pos) - W. All from the positions, correct for any positions (tight
    when they ascend inside each document, as zig-zag shards do); without positions, from the
    indices. q_lo / q_hi: the block's smallest / largest query position (for per-tile skips).
    """
    lo = k_len * 0
    f0 = k_len * 0
    q_lo = m_start
    q_hi = tl.minimum(q_len, m_start + BLOCK_M) - 1
    if IS_CAUSAL:
        if HAS_POS:
            q_lo = tl.min(tl.where(m_valid, q_pos, POS_HIGH))
            q_hi = tl.max(tl.where(m_valid, q_pos, POS_LOW))
            full_end = (first_pos_above(KPOS, k_start, k_len, q_lo, SCAN) // BLOCK_N) * BLOCK_N
            end = end_of_pos_at_most(KPOS, k_start, k_len, q_hi, SCAN)
            if HAS_WINDOW:
                lo = (first_pos_above(KPOS, k_start, k_len, q_lo - window, SCAN) // BLOCK_N) * BLOCK_N
                inside_all = end_of_pos_at_most(KPOS, k_start, k_len, q_hi - window, SCAN)
                f0 = tl.maximum(tl.cdiv(inside_all, BLOCK_N) * BLOCK_N, lo)
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


_NO_COUNTER: dict[torch.device, torch.Tensor] = {}


def no_counter(device: torch.device) -> torch.Tensor:
    """A stand-in for the tile counter when nothing is counted (never written), one per device."""
    if device not in _NO_COUNTER:
        _NO_COUNTER[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return _NO_COUNTER[device]


# Tile audit: while ``count_tiles`` is active the kernels add the (query block, key block) tiles
# they compute to TILE_COUNTER: [forward, dK/dV backward, dQ backward]. Off (the default) the
# counting code is not compiled in (a constexpr flag).
TILE_COUNTER: list[torch.Tensor] = []


class count_tiles:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with count_tiles(device) as tiles: ...`` then ``tiles.tolist()`` = [fwd, dkdv, dq] tiles."""

    def __init__(self, device) -> None:
        self.tiles = torch.zeros(3, dtype=torch.int32, device=device)

    def __enter__(self) -> torch.Tensor:
        TILE_COUNTER.append(self.tiles)
        return self.tiles

    def __exit__(self, *exc) -> None:
        TILE_COUNTER.remove(self.tiles)


def tile_counter(device: torch.device) -> tuple[torch.Tensor, bool]:
    """(counter tensor, counting?) for a launch."""
    if TILE_COUNTER:
        return TILE_COUNTER[-1], True
    return no_counter(device), False


def scan_block() -> int:
    """Positions read per step when a program derives its loop bounds from positions."""
    return 64 if INTERPRET else 1024
