"""Triton depthwise causal conv1d (+ activation), forward and backward, on packed documents.

A program owns a block of BT tokens inside one document (xorl_kernels/doc_chunks.py: blocks never
cross a document start) and BD channels. Tap i of token t reads x[t - (W-1) + i] when that is
inside the document, else the document's initial state (or 0), so nothing leaks across
cu_seqlens boundaries. The W taps are unrolled (W is a constexpr, 4 in every Qwen3.5 / Qwen3-Next
config).

Backward, two launches:
1. ``_dz_kernel``: recomputes z, writes dz = dy * act'(z) (fp32) and reduces dweight and dbias over
   its tokens. Each program walks a strided set of blocks (programs ~ 4 x SMs) and writes one
   partial per program, so the partial buffer stays [programs, W + 1, dim] however long the input.
2. ``_dx_kernel``: dx[t] = sum_i weight[i] dz[t + (W-1) - i] over the taps that stay inside the
   document, and, in a document's first block, the initial state's gradient (the taps that read it).
All arithmetic is fp32 (inputs are widened on load; see gated_delta/triton_common.py for why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting
from xorl_kernels.doc_chunks import DocChunks

INTERPRET = triton_interpreting()


def token_block() -> int:
    return 16 if INTERPRET else 64


def alloc_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised kernel output; the tests replace this to hand the kernels NaN-poisoned buffers."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _tap(X, INIT, rows, valid, cols, cmask, bos, doc, i, dim, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """x[t - (W-1) + i] for the block's rows (the initial state before the document start), fp32."""
    src = rows - (W - 1) + i
    inside = src >= bos
    mask = valid[:, None] & cmask[None, :]
    tap = tl.load(X + src.to(tl.int64)[:, None] * dim + cols[None, :], mask=mask & inside[:, None], other=0.0)
    tap = tap.to(tl.float32)
    if HAS_INIT:
        j = src - bos + (W - 1)  # the slot in initial_state[doc] [dim, W-1] when src < bos
        early = tl.load(INIT + (doc.to(tl.int64) * dim + cols[None, :]) * (W - 1) + j[:, None],
                        mask=mask & (src < bos)[:, None], other=0.0)
        tap += early.to(tl.float32)
    return tap


@triton.jit
def _pre_activation(X, WT, BIAS, INIT, rows, valid, cols, cmask, bos, doc, dim, W: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    z = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(W):
        w_i = tl.load(WT + cols * W + i, mask=cmask, other=0.0).to(tl.float32)
        z += w_i[None, :] * _tap(X, INIT, rows, valid, cols, cmask, bos, doc, i, dim, W, HAS_INIT)
    return z


@triton.jit
def _block(CH_START, CH_END, CH_DOC, CU, c, BT: tl.constexpr):
    start = tl.load(CH_START + c)
    end = tl.load(CH_END + c)
    doc = tl.load(CH_DOC + c)
    rows = start + tl.arange(0, BT)
    return start, rows, rows < end, doc, tl.load(CU + doc), tl.load(CU + doc + 1)


@triton.jit
def _fwd_kernel(X, WT, BIAS, INIT, Y, CH_START, CH_END, CH_DOC, CU, dim, W: tl.constexpr, SILU: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    start, rows, valid, doc, bos, eos = _block(CH_START, CH_END, CH_DOC, CU, tl.program_id(0), BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    z = _pre_activation(X, WT, BIAS, INIT, rows, valid, cols, cmask, bos, doc, dim, W, HAS_BIAS, HAS_INIT, BT, BD)
    if SILU:
        z = z * tl.sigmoid(z)
    tl.store(Y + rows.to(tl.int64)[:, None] * dim + cols[None, :], z.to(Y.dtype.element_ty),
             mask=valid[:, None] & cmask[None, :])


@triton.jit
def _dz_kernel(X, WT, BIAS, INIT, DY, DZ, DW_PART, CH_START, CH_END, CH_DOC, CU, dim, num_chunks,
               W: tl.constexpr, WP: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_INIT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    db = tl.zeros([BD], dtype=tl.float32)
    # dweight's W taps as the rows of one [WP, BD] accumulator (WP = W rounded up to a power of two).
    taps = tl.arange(0, WP)
    dw = tl.zeros([WP, BD], dtype=tl.float32)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        start, rows, valid, doc, bos, eos = _block(CH_START, CH_END, CH_DOC, CU, c, BT)
        z = _pre_activation(X, WT, BIAS, INIT, rows, valid, cols, cmask, bos, doc, dim, W, HAS_BIAS, HAS_INIT,
                            BT, BD)
        mask = valid[:, None] & cmask[None, :]
        dz = tl.load(DY + rows.to(tl.int64)[:, None] * dim + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SILU:
            s = tl.sigmoid(z)
            dz = dz * s * (1.0 + z * (1.0 - s))
        tl.store(DZ + rows.to(tl.int64)[:, None] * dim + cols[None, :], dz, mask=mask)
        db += tl.sum(dz, 0)
        for i in tl.static_range(W):
            tap = _tap(X, INIT, rows, valid, cols, cmask, bos, doc, i, dim, W, HAS_INIT)
            dw += tl.where(taps[:, None] == i, tl.sum(dz * tap, 0)[None, :], 0.0)
    base = DW_PART + pid.to(tl.int64) * (W + 1) * dim
    tl.store(base + taps[:, None] * dim + cols[None, :], dw, mask=(taps[:, None] < W) & cmask[None, :])
    tl.store(base + W * dim + cols, db, mask=cmask)


@triton.jit
def _dx_kernel(WT, DZ, DX, DINIT, CH_START, CH_END, CH_DOC, CU, dim, W: tl.constexpr, HAS_INIT: tl.constexpr,
               BT: tl.constexpr, BD: tl.constexpr):
    start, rows, valid, doc, bos, eos = _block(CH_START, CH_END, CH_DOC, CU, tl.program_id(0), BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    dx = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(WT + cols * W + i, mask=cmask, other=0.0).to(tl.float32)
        dst = rows + (W - 1) - i  # the output that read x[t] through tap i
        inside = valid & (dst < eos)
        dz = tl.load(DZ + dst.to(tl.int64)[:, None] * dim + cols[None, :], mask=inside[:, None] & cmask[None, :],
                     other=0.0)
        dx += w_i[None, :] * dz
    tl.store(DX + rows.to(tl.int64)[:, None] * dim + cols[None, :], dx.to(DX.dtype.element_ty),
             mask=valid[:, None] & cmask[None, :])
    if HAS_INIT:
        if start == bos:  # the document's first block also owns the initial state's gradient
            for j in tl.static_range(W - 1):  # slot j holds position bos - (W-1) + j
                acc = tl.zeros([BD], dtype=tl.float32)
                for i in tl.static_range(j + 1):  # outputs bos + j - i read slot j through tap i
                    w_i = tl.load(WT + cols * W + i, mask=cmask, other=0.0).to(tl.float32)
                    src = cols * 0 + (bos + j - i)  # as a vector: the interpreter takes no scalar in a mask
                    acc += w_i * tl.load(DZ + src.to(tl.int64) * dim + cols, mask=cmask & (src < eos), other=0.0)
                tl.store(DINIT + (doc.to(tl.int64) * dim + cols) * (W - 1) + j, acc.to(DINIT.dtype.element_ty),
                         mask=cmask)


def _programs(num_chunks: int, device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return max(1, min(num_chunks, 4))
    return max(1, min(num_chunks, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


def _channel_block(dim: int) -> int:
    return min(128 if not INTERPRET else 32, triton.next_power_of_2(dim))


def causal_conv1d_forward_triton(x, weight, bias, silu: bool, initial_state, chunks: DocChunks):
    """y [tokens, dim] in x's dtype; x packed contiguous [tokens, dim], weight [dim, W] contiguous."""
    tokens, dim = x.shape
    y = alloc_output(x.shape, x.dtype, x.device)
    if chunks.num_chunks:
        bd = _channel_block(dim)
        _fwd_kernel[(chunks.num_chunks, triton.cdiv(dim, bd))](
            x, weight, bias if bias is not None else weight, initial_state if initial_state is not None else x, y,
            chunks.chunk_start, chunks.chunk_end, chunks.chunk_doc, chunks.cu_seqlens, dim, W=weight.shape[1],
            SILU=silu, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, BT=token_block(), BD=bd)
    return y


def causal_conv1d_backward_triton(dy, x, weight, bias, silu: bool, initial_state, chunks: DocChunks):
    """(dx, dweight, dbias or None, d_initial_state or None)."""
    tokens, dim = x.shape
    width = weight.shape[1]
    bd = _channel_block(dim)
    programs = _programs(chunks.num_chunks, x.device)
    dz = alloc_output(x.shape, torch.float32, x.device)
    partial = alloc_output((programs, width + 1, dim), torch.float32, x.device)
    dx = alloc_output(x.shape, x.dtype, x.device)
    d_init = alloc_output(initial_state.shape, initial_state.dtype, x.device) if initial_state is not None else None
    init = initial_state if initial_state is not None else x
    tables = (chunks.chunk_start, chunks.chunk_end, chunks.chunk_doc, chunks.cu_seqlens)
    common = dict(W=width, HAS_INIT=initial_state is not None, BT=token_block(), BD=bd)
    _dz_kernel[(programs, triton.cdiv(dim, bd))](
        x, weight, bias if bias is not None else weight, init, dy, dz, partial, *tables, dim, chunks.num_chunks,
        WP=triton.next_power_of_2(width), SILU=silu, HAS_BIAS=bias is not None, **common)
    if chunks.num_chunks:
        _dx_kernel[(chunks.num_chunks, triton.cdiv(dim, bd))](
            weight, dz, dx, d_init if d_init is not None else dz, *tables, dim, **common)
    if d_init is not None and chunks.num_docs:
        # A document with no tokens has no first block: its initial state reaches nothing.
        empty = (chunks.cu_seqlens[1:] == chunks.cu_seqlens[:-1]).to(d_init.device)
        d_init = torch.where(empty[:, None, None], torch.zeros((), dtype=d_init.dtype, device=d_init.device), d_init)
    sums = partial.sum(0)
    dw = sums[:width].t().to(weight.dtype, memory_format=torch.contiguous_format)
    db = sums[width].to(bias.dtype, copy=True) if bias is not None else None  # not a view of dw's buffer
    return dx, dw, db, d_init
