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
