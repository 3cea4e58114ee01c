"""Triton forward of the chunked gated delta rule (the math: gated_delta/reference.py).

Three launches, the first and last parallel over every chunk of every document, the middle one
sequential over a document's chunks:

1. ``_wy_kernel`` (chunk x value head): γ = cumsum(g), the unit lower-triangular
   A = β K̂K̂^T ∘ exp(γ_i - γ_j), T = (I + A)^-1, U = T (β ⊙ V) and W = T (βΓ ⊙ K̂). Optionally T
   itself, which the backward reuses.
2. ``_state_kernel`` (document x value head x d_v block): the scan over chunks, starting from the
   document's initial state (or zero: every document start resets the state). It writes the
   state entering each chunk, the deltas Δ = U - W S and the document's final state, all in fp32
   registers across the whole document.
3. ``_output_kernel`` (chunk x value head x d_v block): O = (Q̂ ⊙ Γ) S + (Q̂K̂^T ∘ M) Δ.

The backward (bwd_triton.py) runs 1 and 2 again rather than keeping their outputs: U, W, Δ and the
per-chunk states are [T, heads_v, d] fp32 and [chunks, heads_v, d_k, d_v], more than the inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.doc_chunks import DocChunks
from xorl_kernels.gated_delta import triton_common as tc
from xorl_kernels.gated_delta.triton_common import (
    chunk_bounds,
    l2norm_rows,
    load_rows,
    load_vec,
    pair_decay,
    state_tile,
    store_rows,
    unit_lower_inverse,
)


@triton.jit
def _wy_kernel(K, V, G, BETA, GC, U, W, TM, CH_START, CH_END, heads_v, group,
               DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               L2NORM: tl.constexpr, STORE_T: tl.constexpr, DOT_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    k, _ = l2norm_rows(load_rows(K + hk * DK, rows, valid, (heads_v // group) * DK, offs_k, DK), L2NORM)
    g = load_vec(G + h, rows, valid, heads_v)
    b = load_vec(BETA + h, rows, valid, heads_v)
    gc = tl.cumsum(g, 0)  # padded rows have g = 0, so they carry the chunk's total decay
    tl.store(GC + rows.to(tl.int64) * heads_v + h, gc, mask=valid)
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PREC)
    a = kk * b[:, None] * pair_decay(gc, offs_c, True)
    t = unit_lower_inverse(a, offs_c, BC)
    w = tl.dot(t, k * (b * tl.exp(gc))[:, None], input_precision=DOT_PREC)
    store_rows(W + h * DK, w, rows, valid, heads_v * DK, offs_k, DK)
    for iv in range(0, (DV + BV - 1) // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        v = load_rows(V + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        u = tl.dot(t, v * b[:, None], input_precision=DOT_PREC)
        store_rows(U + h * DV, u, rows, valid, heads_v * DV, offs_v, DV)
    if STORE_T:
        store_rows(TM + h * BC, t, rows, valid, heads_v * BC, offs_c, BC)


@triton.jit
def _state_kernel(K, W, U, GC, H, VN, INIT, FINAL, CH_START, CH_END, DOC_OFF, heads_v, group,
                  DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, DOT_PREC: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    doc_head = (n * heads_v + h).to(tl.int64) * DK * DV
    if HAS_INIT:
        init_ptrs, init_mask = state_tile(INIT + doc_head, offs_k, offs_v, DK, DV)
        s = tl.load(init_ptrs, mask=init_mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    # (names inside the loop are its own: a loop-carried name must keep its type in compiled Triton)
    for c in range(tl.load(DOC_OFF + n), tl.load(DOC_OFF + n + 1)):
        h_ptrs, h_mask = state_tile(H + (c * heads_v + h).to(tl.int64) * DK * DV, offs_k, offs_v, DK, DV)
        tl.store(h_ptrs, s.to(H.dtype.element_ty), mask=h_mask)
        start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
        w = load_rows(W + h * DK, rows, valid, heads_v * DK, offs_k, DK)
        u = load_rows(U + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        delta = u - tl.dot(w, s, input_precision=DOT_PREC)
        store_rows(VN + h * DV, delta, rows, valid, heads_v * DV, offs_v, DV)
        k, _ = l2norm_rows(load_rows(K + hk * DK, rows, valid, (heads_v // group) * DK, offs_k, DK), L2NORM)
        gc = load_vec(GC + h, rows, valid, heads_v)
        g_last = tl.load(GC + (end - 1).to(tl.int64) * heads_v + h)
        k_to_end = tl.where(valid[:, None], k * tl.exp(g_last - gc)[:, None], 0.0)
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k_to_end), delta, input_precision=DOT_PREC)
    ptrs, mask = state_tile(FINAL + doc_head, offs_k, offs_v, DK, DV)
    tl.store(ptrs, s, mask=mask)


@triton.jit
def _output_kernel(Q, K, GC, H, VN, O, CH_START, CH_END, heads_v, group, scale,
                   DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   L2NORM: tl.constexpr, DOT_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    stride_qk = (heads_v // group) * DK
    q, _ = l2norm_rows(load_rows(Q + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
    q = q * scale
    k, _ = l2norm_rows(load_rows(K + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
    gc = load_vec(GC + h, rows, valid, heads_v)
    ptrs, mask = state_tile(H + (c * heads_v + h).to(tl.int64) * DK * DV, offs_k, offs_v, DK, DV)
    s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    out = tl.dot(q * tl.exp(gc)[:, None], s, input_precision=DOT_PREC)
    p = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * pair_decay(gc, offs_c, False)
    delta = load_rows(VN + h * DV, rows, valid, heads_v * DV, offs_v, DV)
    out += tl.dot(p, delta, input_precision=DOT_PREC)
    store_rows(O + h * DV, out, rows, valid, heads_v * DV, offs_v, DV)


def block_sizes(dk: int, dv: int, chunk_size: int) -> dict:
    return dict(DK=dk, DV=dv, BC=chunk_size, BK=tc.head_block(dk), BV=tc.value_block(dv))


def wy_and_states(q, k, v, g, beta, initial_state, chunks: DocChunks, use_qk_l2norm: bool, chunk_size: int,
                  store_t: bool) -> dict:
    """Launches 1 and 2: {gc, u, w, t (or None), states, deltas, final} (see the module docstring)."""
    total, heads_v, dv = v.shape
    dk = q.shape[-1]
    group = heads_v // k.shape[1]
    dev, f32 = v.device, torch.float32
    sizes = block_sizes(dk, dv, chunk_size)
    prec = tc.dot_precision(q.dtype)
    gc = tc.alloc_output((total, heads_v), f32, dev)
    u = tc.alloc_output((total, heads_v, dv), f32, dev)
    w = tc.alloc_output((total, heads_v, dk), f32, dev)
    t = tc.alloc_output((total, heads_v, chunk_size), f32, dev) if store_t else None
    # The per-chunk states are the largest intermediate; kept in the inputs' dtype (fp32 for fp32),
    # while the running state itself stays in fp32 registers.
    states = tc.alloc_output((chunks.num_chunks, heads_v, dk, dv), k.dtype, dev)
    deltas = tc.alloc_output((total, heads_v, dv), f32, dev)
    final = tc.alloc_output((chunks.num_docs, heads_v, dk, dv), f32, dev)
    if chunks.num_chunks:
        _wy_kernel[(chunks.num_chunks, heads_v)](
            k, v, g, beta, gc, u, w, t if store_t else gc, chunks.chunk_start, chunks.chunk_end, heads_v, group,
            L2NORM=use_qk_l2norm, STORE_T=store_t, DOT_PREC=prec, **sizes, **tc.LAUNCH)
    if chunks.num_docs:
        grid = (chunks.num_docs, heads_v, triton.cdiv(dv, sizes["BV"]))
        _state_kernel[grid](
            k, w, u, gc, states, deltas, initial_state if initial_state is not None else final, final,
            chunks.chunk_start, chunks.chunk_end, chunks.doc_chunk_offsets, heads_v, group,
            L2NORM=use_qk_l2norm, HAS_INIT=initial_state is not None, DOT_PREC=prec, **sizes, **tc.LAUNCH)
    return dict(gc=gc, u=u, w=w, t=t, states=states, deltas=deltas, final=final)


def gated_delta_forward_triton(q, k, v, g, beta, scale: float, initial_state, chunks: DocChunks,
                               use_qk_l2norm: bool, chunk_size: int):
    """(out [T, heads_v, d_v] in q's dtype, final_state [docs, heads_v, d_k, d_v] fp32) on the packed form."""
    tc.check_device(q, k, v, g, beta, initial_state)
    total, heads_v, dv = v.shape
    parts = wy_and_states(q, k, v, g, beta, initial_state, chunks, use_qk_l2norm, chunk_size, store_t=False)
    out = tc.alloc_output((total, heads_v, dv), q.dtype, v.device)
    if chunks.num_chunks:
        sizes = block_sizes(q.shape[-1], dv, chunk_size)
        _output_kernel[(chunks.num_chunks, heads_v, triton.cdiv(dv, sizes["BV"]))](
            q, k, parts["gc"], parts["states"], parts["deltas"], out, chunks.chunk_start, chunks.chunk_end,
            heads_v, heads_v // k.shape[1], float(scale), L2NORM=use_qk_l2norm, DOT_PREC=tc.dot_precision(q.dtype),
            **sizes, **tc.LAUNCH)
    return out, parts["final"]
