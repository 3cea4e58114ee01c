"""Triton backward of the chunked gated delta rule (the formulas: gated_delta/reference.py, _chunk_backward).

After recomputing the forward's launches 1 and 2 (fwd_triton.wy_and_states, now also keeping T):

4. ``_delta_grad_local_kernel`` (chunk x head x d_v block): the chunk-local part of dΔ, P^T dO.
5. ``_state_grad_kernel`` (document x head x d_v block): the reverse scan. From the final state's
   gradient (or zero) it walks the document's chunks backwards, adds the incoming state-gradient
   part to dΔ (K̂ ⊙ exp(γ_C - γ)) dS', keeps dS' per chunk and steps
   dS = exp(γ_C) dS' + (Q̂ ⊙ Γ)^T dO - W^T dΔ; what is left at the document start is the initial
   state's gradient.
6. ``_qk_grad_kernel`` (chunk x head, looping over d_v): dQ̂ (finished: through the l2norm
   backward), the output and state-update parts of dK̂ and dγ, and dW = -dΔ S^T.
7. ``_wy_grad_kernel`` (chunk x head): through U = T (β ⊙ V), W = T (βΓ ⊙ K̂) and T = (I + A)^-1:
   dv, dβ, the rest of dK̂ and dγ; then dg = the reverse cumsum of dγ inside the chunk and dk through
   the l2norm backward.

dq and dk come out per value head ([T, heads_v, d_k] fp32) and are summed over the value heads
that share a key head afterwards (GQA), which keeps every program's writes its own (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.doc_chunks import DocChunks
from xorl_kernels.gated_delta import triton_common as tc
from xorl_kernels.gated_delta.fwd_triton import block_sizes, wy_and_states
from xorl_kernels.gated_delta.triton_common import (
    chunk_bounds,
    l2norm_rows,
    l2norm_rows_backward,
    load_rows,
    load_vec,
    pair_decay,
    state_tile,
    store_rows,
)


@triton.jit
def _delta_grad_local_kernel(Q, K, GC, DO, DVN, CH_START, CH_END, heads_v, group, scale,
                             DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, L2NORM: tl.constexpr, DOT_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    stride_qk = (heads_v // group) * DK
    q, _ = l2norm_rows(load_rows(Q + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
    k, _ = l2norm_rows(load_rows(K + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
    gc = load_vec(GC + h, rows, valid, heads_v)
    p = tl.dot(q * scale, tl.trans(k), input_precision=DOT_PREC) * pair_decay(gc, offs_c, False)
    do = load_rows(DO + h * DV, rows, valid, heads_v * DV, offs_v, DV)
    store_rows(DVN + h * DV, tl.dot(tl.trans(p), do, input_precision=DOT_PREC), rows, valid, heads_v * DV,
               offs_v, DV)


@triton.jit
def _state_grad_kernel(Q, K, GC, W, DO, DVN, DH, DFINAL, DINIT, CH_START, CH_END, DOC_OFF, heads_v, group,
                       scale, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, L2NORM: tl.constexpr, HAS_DFINAL: tl.constexpr, DOT_PREC: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    stride_qk = (heads_v // group) * DK
    doc_head = (n * heads_v + h).to(tl.int64) * DK * DV
    if HAS_DFINAL:
        final_ptrs, final_mask = state_tile(DFINAL + doc_head, offs_k, offs_v, DK, DV)
        ds = tl.load(final_ptrs, mask=final_mask, other=0.0).to(tl.float32)
    else:
        ds = tl.zeros([BK, BV], dtype=tl.float32)
    first = tl.load(DOC_OFF + n)
    last = tl.load(DOC_OFF + n + 1)
    for i in range(0, last - first):
        c = last - 1 - i
        dh_ptrs, dh_mask = state_tile(DH + (c * heads_v + h).to(tl.int64) * DK * DV, offs_k, offs_v, DK, DV)
        tl.store(dh_ptrs, ds.to(DH.dtype.element_ty), mask=dh_mask)
        start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
        k, _ = l2norm_rows(load_rows(K + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
        gc = load_vec(GC + h, rows, valid, heads_v)
        g_last = tl.load(GC + (end - 1).to(tl.int64) * heads_v + h)
        k_to_end = tl.where(valid[:, None], k * tl.exp(g_last - gc)[:, None], 0.0)
        d_delta = load_rows(DVN + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        d_delta += tl.dot(k_to_end, ds, input_precision=DOT_PREC)
        store_rows(DVN + h * DV, d_delta, rows, valid, heads_v * DV, offs_v, DV)
        q, _ = l2norm_rows(load_rows(Q + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
        q_decayed = q * (scale * tl.exp(gc))[:, None]
        do = load_rows(DO + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        w = load_rows(W + h * DK, rows, valid, heads_v * DK, offs_k, DK)
        ds = (ds * tl.exp(g_last) + tl.dot(tl.trans(q_decayed), do, input_precision=DOT_PREC)
              - tl.dot(tl.trans(w), d_delta, input_precision=DOT_PREC))
    ptrs, mask = state_tile(DINIT + doc_head, offs_k, offs_v, DK, DV)
    tl.store(ptrs, ds, mask=mask)


@triton.jit
def _qk_grad_kernel(Q, K, GC, H, DH, VN, DVN, DO, DQ, DK_PART, DG_PART, DW, CH_START, CH_END, heads_v, group,
                    scale, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, L2NORM: tl.constexpr, DOT_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    stride_qk = (heads_v // group) * DK
    qn, q_rinv = l2norm_rows(load_rows(Q + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
    q = qn * scale
    k, _ = l2norm_rows(load_rows(K + hk * DK, rows, valid, stride_qk, offs_k, DK), L2NORM)
    gc = load_vec(GC + h, rows, valid, heads_v)
    g_last = tl.load(GC + (end - 1).to(tl.int64) * heads_v + h)
    e = tl.exp(gc)
    e_to_end = tl.where(valid, tl.exp(g_last - gc), 0.0)
    d_out_state = tl.zeros([BC, BK], dtype=tl.float32)  # dO S^T
    d_ktilde = tl.zeros([BC, BK], dtype=tl.float32)  # Δ dS'^T
    dw = tl.zeros([BC, BK], dtype=tl.float32)  # -dΔ S^T
    dp = tl.zeros([BC, BC], dtype=tl.float32)  # dO Δ^T
    state_dot = tl.zeros([BK], dtype=tl.float32)  # sum(S ⊙ dS'), reduced to a scalar below
    state_base = (c * heads_v + h).to(tl.int64) * DK * DV
    for iv in range(0, (DV + BV - 1) // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        s_ptrs, s_mask = state_tile(H + state_base, offs_k, offs_v, DK, DV)
        s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        ds_ptrs, ds_mask = state_tile(DH + state_base, offs_k, offs_v, DK, DV)
        ds = tl.load(ds_ptrs, mask=ds_mask, other=0.0).to(tl.float32)
        delta = load_rows(VN + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        d_delta = load_rows(DVN + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        do = load_rows(DO + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        d_out_state += tl.dot(do, tl.trans(s), input_precision=DOT_PREC)
        d_ktilde += tl.dot(delta, tl.trans(ds), input_precision=DOT_PREC)
        dw -= tl.dot(d_delta, tl.trans(s), input_precision=DOT_PREC)
        dp += tl.dot(do, tl.trans(delta), input_precision=DOT_PREC)
        state_dot += tl.sum(s * ds, 1)
    decay = pair_decay(gc, offs_c, False)
    dp_decayed = dp * decay
    dq = e[:, None] * d_out_state + tl.dot(dp_decayed, k, input_precision=DOT_PREC)
    dk = tl.dot(tl.trans(dp_decayed), q, input_precision=DOT_PREC) + e_to_end[:, None] * d_ktilde
    r = dp * tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * decay  # dP ∘ P
    t_j = tl.sum(k * e_to_end[:, None] * d_ktilde, 1)
    d_last = tl.exp(g_last) * tl.sum(state_dot, 0) + tl.sum(t_j, 0)
    dgc = tl.sum(q * e[:, None] * d_out_state, 1) + tl.sum(r, 1) - tl.sum(r, 0) - t_j
    dgc += tl.where(rows == end - 1, d_last, 0.0)  # γ_C is γ at the chunk's last real token
    dq = l2norm_rows_backward(qn, q_rinv, dq * scale, L2NORM)
    store_rows(DQ + h * DK, dq, rows, valid, heads_v * DK, offs_k, DK)
    store_rows(DK_PART + h * DK, dk, rows, valid, heads_v * DK, offs_k, DK)
    store_rows(DW + h * DK, dw, rows, valid, heads_v * DK, offs_k, DK)
    tl.store(DG_PART + rows.to(tl.int64) * heads_v + h, tl.where(valid, dgc, 0.0), mask=valid)


@triton.jit
def _wy_grad_kernel(K, V, BETA, GC, TM, DVN, DW, DK_PART, DG_PART, DK_OUT, DV_OUT, DG_OUT, DB_OUT, CH_START,
                    CH_END, heads_v, group, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, DOT_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    start, end, rows, valid = chunk_bounds(CH_START, CH_END, c, BC)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    k, k_rinv = l2norm_rows(load_rows(K + hk * DK, rows, valid, (heads_v // group) * DK, offs_k, DK), L2NORM)
    b = load_vec(BETA + h, rows, valid, heads_v)
    gc = load_vec(GC + h, rows, valid, heads_v)
    e = tl.exp(gc)
    t = load_rows(TM + h * BC, rows, valid, heads_v * BC, offs_c, BC)
    dw = load_rows(DW + h * DK, rows, valid, heads_v * DK, offs_k, DK)
    d_bk = tl.dot(tl.trans(t), dw, input_precision=DOT_PREC)  # through W = T (βΓ ⊙ K̂)
    d_t = tl.dot(dw, tl.trans(k * (b * e)[:, None]), input_precision=DOT_PREC)
    dbeta = tl.zeros([BC], dtype=tl.float32)
    for iv in range(0, (DV + BV - 1) // BV):  # through U = T (β ⊙ V); dU = dΔ
        offs_v = iv * BV + tl.arange(0, BV)
        v = load_rows(V + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        du = load_rows(DVN + h * DV, rows, valid, heads_v * DV, offs_v, DV)
        d_bv = tl.dot(tl.trans(t), du, input_precision=DOT_PREC)
        store_rows(DV_OUT + h * DV, d_bv * b[:, None], rows, valid, heads_v * DV, offs_v, DV)
        dbeta += tl.sum(v * d_bv, 1)
        d_t += tl.dot(du, tl.trans(v * b[:, None]), input_precision=DOT_PREC)
    s_k = tl.sum(k * d_bk, 1)
    dbeta += e * s_k
    dk = (b * e)[:, None] * d_bk
    dgc = b * e * s_k
    # T = (I + A)^-1: dA = -T^T dT T^T on the strictly lower triangle
    d_a = -tl.dot(tl.trans(t), tl.dot(d_t, tl.trans(t), input_precision=DOT_PREC), input_precision=DOT_PREC)
    decay = pair_decay(gc, offs_c, True)  # zero on and above the diagonal, which masks d_a too
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PREC)
    dbeta += tl.sum(d_a * kk * decay, 1)
    dkk = d_a * b[:, None] * decay
    dk += tl.dot(dkk, k, input_precision=DOT_PREC) + tl.dot(tl.trans(dkk), k, input_precision=DOT_PREC)
    r = dkk * kk  # dA ∘ A
    dgc += tl.sum(r, 1) - tl.sum(r, 0)
    dgc = tl.where(valid, dgc + load_vec(DG_PART + h, rows, valid, heads_v), 0.0)
    dg = tl.sum(dgc, 0) - tl.cumsum(dgc, 0) + dgc  # γ = cumsum(g): dg_s = sum over t >= s of dγ_t
    tl.store(DG_OUT + rows.to(tl.int64) * heads_v + h, dg, mask=valid)
    tl.store(DB_OUT + rows.to(tl.int64) * heads_v + h, dbeta, mask=valid)
    dk += load_rows(DK_PART + h * DK, rows, valid, heads_v * DK, offs_k, DK)
    store_rows(DK_OUT + h * DK, l2norm_rows_backward(k, k_rinv, dk, L2NORM), rows, valid, heads_v * DK, offs_k,
               DK)


def gated_delta_backward_triton(d_out, d_final, q, k, v, g, beta, scale: float, initial_state,
                                chunks: DocChunks, use_qk_l2norm: bool, chunk_size: int):
    """(dq, dk, dv, dg, dbeta, d_initial_state fp32 [docs, heads_v, d_k, d_v]) on the packed form;
    d_final may be None (the final state did not reach the loss)."""
    tc.check_device(d_out, q, k, v, g, beta, initial_state, d_final)
    total, heads_v, dv = v.shape
    dk_dim = q.shape[-1]
    group = heads_v // k.shape[1]
    dev, f32 = v.device, torch.float32
    sizes = block_sizes(dk_dim, dv, chunk_size)
    prec = tc.dot_precision(q.dtype)
    fwd = wy_and_states(q, k, v, g, beta, initial_state, chunks, use_qk_l2norm, chunk_size, store_t=True)
    d_delta = tc.alloc_output((total, heads_v, dv), f32, dev)
    d_states = tc.alloc_output(fwd["states"].shape, fwd["states"].dtype, dev)
    d_init = tc.alloc_output((chunks.num_docs, heads_v, dk_dim, dv), f32, dev)
    dq_heads, dk_part, dw, dk_heads = (tc.alloc_output((total, heads_v, dk_dim), f32, dev) for _ in range(4))
    dg_part, dg, dbeta = (tc.alloc_output((total, heads_v), f32, dev) for _ in range(3))
    dv_out = tc.alloc_output(v.shape, v.dtype, dev)
    tables = (chunks.chunk_start, chunks.chunk_end)
    v_blocks = triton.cdiv(dv, sizes["BV"])
    opts = dict(L2NORM=use_qk_l2norm, DOT_PREC=prec, **sizes, **tc.LAUNCH)
    if chunks.num_chunks:
        _delta_grad_local_kernel[(chunks.num_chunks, heads_v, v_blocks)](
            q, k, fwd["gc"], d_out, d_delta, *tables, heads_v, group, float(scale), **opts)
    if chunks.num_docs:
        _state_grad_kernel[(chunks.num_docs, heads_v, v_blocks)](
            q, k, fwd["gc"], fwd["w"], d_out, d_delta, d_states, d_final if d_final is not None else d_init, d_init,
            *tables, chunks.doc_chunk_offsets, heads_v, group, float(scale), HAS_DFINAL=d_final is not None, **opts)
    if chunks.num_chunks:
        _qk_grad_kernel[(chunks.num_chunks, heads_v)](
            q, k, fwd["gc"], fwd["states"], d_states, fwd["deltas"], d_delta, d_out, dq_heads, dk_part, dg_part, dw,
            *tables, heads_v, group, float(scale), **opts)
        _wy_grad_kernel[(chunks.num_chunks, heads_v)](
            k, v, beta, fwd["gc"], fwd["t"], d_delta, dw, dk_part, dg_part, dk_heads, dv_out, dg, dbeta, *tables,
            heads_v, group, **opts)
    heads_k = k.shape[1]
    dq = dq_heads.view(total, heads_k, group, dk_dim).sum(2)
    dk = dk_heads.view(total, heads_k, group, dk_dim).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv_out, dg.to(g.dtype), dbeta.to(beta.dtype), d_init
