"""Pieces shared by the gated delta rule's Triton kernels (fwd_triton.py, bwd_triton.py).

Every kernel works on the packed, contiguous form: q, k [T, heads_k, d_k], v [T, heads_v, d_v],
g, beta [T, heads_v]; per-token intermediates are [T, heads_v, ...] fp32 and per-chunk states
[chunks, heads_v, d_k, d_v]. A program owns one chunk (xorl_kernels/doc_chunks.py) of one value
head, or one document of one value head for the sequential state scans.

Arithmetic is fp32 throughout: tiles are widened right after loading and dots run in fp32
("ieee" for fp32 inputs, so the fp32 path matches the float64 reference to ~1e-6; tf32 for 16-bit
inputs). Besides accuracy (the state is accumulated over a whole document in fp32, as the brief
asks), this keeps the Triton interpreter correct: it computes 16-bit dots on raw bits
(attention/common.py: upcast_16bit). Feeding the dots bf16 operands is the obvious speed lever on a
GPU and is left for the GPU-proof issue, where it can be measured.

Only plain pointer arithmetic, tl.dot, tl.cumsum and reductions are used (no block pointers, no
TMA descriptors), so the same code runs on the GPU image's Triton 3.6 and the dev image's 3.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting

INTERPRET = triton_interpreting()
L2NORM_EPS = tl.constexpr(1e-6)  # inside the rsqrt, as transformers' and fla's l2norm
# Two stages for the loads the state scans and the d_v loops prefetch: Triton's default 3 takes up
# to 1.6x the shared memory (80 vs 56 KiB for the forward scan at 32-token chunks, d = 128, bf16)
# for a loop whose trip count is the chunks of one document.
LAUNCH = dict(num_warps=4, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def head_block(dim: int) -> int:
    """A padded head dim: tl.arange needs a power of two and tl.dot at least 16."""
    return max(16, triton.next_power_of_2(dim))


def value_block(dim_v: int) -> int:
    """Value columns per program in the kernels that split d_v (a state tile is [BK, BV] fp32)."""
    return min(64, head_block(dim_v))


def check_device(*tensors: torch.Tensor) -> None:
    if not INTERPRET and not all(t.is_cuda for t in tensors if t is not None):
        raise RuntimeError("the Triton gated delta rule needs CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                           "before importing triton, or use backend='reference'")


def alloc_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised kernel output; the tests replace this to hand the kernels NaN-poisoned buffers."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def load_rows(base, rows, valid, stride_t, offs, DIM: tl.constexpr):
    """[rows, block] fp32 tile of ``base[row * stride_t + col]``; rows or columns outside read as 0."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + offs[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (offs[None, :] < DIM), other=0.0).to(tl.float32)


@triton.jit
def store_rows(base, value, rows, valid, stride_t, offs, DIM: tl.constexpr):
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + offs[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=valid[:, None] & (offs[None, :] < DIM))


@triton.jit
def load_vec(base, rows, valid, stride_t):
    return tl.load(base + rows.to(tl.int64) * stride_t, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def l2norm_rows(x, L2NORM: tl.constexpr):
    """(x / sqrt(|x|^2 + eps), 1 / sqrt(|x|^2 + eps)) per row; (x, 1) when L2NORM is off."""
    if L2NORM:
        rinv = 1.0 / tl.sqrt(tl.sum(x * x, 1) + L2NORM_EPS)
    else:
        rinv = tl.full([x.shape[0]], 1.0, tl.float32)
    return x * rinv[:, None], rinv


@triton.jit
def l2norm_rows_backward(xn, rinv, dxn, L2NORM: tl.constexpr):
    """d x from d x̂ for x̂ = x * rinv(x): rinv * (dx̂ - x̂ (x̂·dx̂)) (identity when L2NORM is off)."""
    dx = dxn
    if L2NORM:
        dx = rinv[:, None] * (dxn - xn * tl.sum(xn * dxn, 1)[:, None])
    return dx  # one return: compiled Triton wants no return inside a branch


@triton.jit
def state_tile(base, offs_k, offs_v, DK: tl.constexpr, DV: tl.constexpr):
    """Pointers and mask of a [BK, BV] tile of a [d_k, d_v] state at ``base``."""
    ptrs = base + offs_k[:, None] * DV + offs_v[None, :]
    return ptrs, (offs_k[:, None] < DK) & (offs_v[None, :] < DV)


@triton.jit
def pair_decay(gc, offs_c, STRICT: tl.constexpr):
    """exp(γ_i - γ_j) on j < i (STRICT) or j <= i, 0 elsewhere; the exponent is masked before exp
    (the upper triangle's is positive and could overflow)."""
    if STRICT:
        keep = offs_c[:, None] > offs_c[None, :]
    else:
        keep = offs_c[:, None] >= offs_c[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, gc[:, None] - gc[None, :], 0.0)), 0.0)


@triton.jit
def unit_lower_inverse(a, offs_c, BC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [BC, BC] A, by forward substitution row by row:
    T_i = e_i - sum_{j<i} A_ij T_j. BC rounds of a [BC, BC] multiply-reduce (no tensor cores); at
    BC = 64 this is a small part of a chunk's work next to its d_k x d_v dots."""
    t = (offs_c[:, None] == offs_c[None, :]).to(tl.float32)
    for i in range(1, BC):
        a_i = tl.sum(tl.where(offs_c[:, None] == i, a, 0.0), 0)  # row i of A, indexed by column j
        t_i = tl.sum(a_i[:, None] * t, 0)  # sum_j A_ij T_j
        t = tl.where(offs_c[:, None] == i, t - t_i[None, :], t)
    return t


@triton.jit
def chunk_bounds(CH_START, CH_END, c, BC: tl.constexpr):
    """(first token, one past the last, the chunk's token indices, which of them are real)."""
    start = tl.load(CH_START + c)
    end = tl.load(CH_END + c)
    rows = start + tl.arange(0, BC)
    return start, end, rows, rows < end
