"""Plain-torch reference for flash attention on the packed (varlen) form, forward and backward.

This is the CPU backend of ``xorl_kernels.flash_attn`` (and the debugging backend on GPU with
``XORL_FORCE_REFERENCE=1``). It works on the canonical packed form that the public layer
normalises every call to:

- ``q`` / ``k`` [total, heads, head_dim_qk], ``v`` [total_k, heads_kv, head_dim_v] (the value
  head dim may differ: MLA uses 192 for q·k and 128 for v; ``out`` has head_dim_v)
  (heads_q % heads_kv == 0: GQA / MQA; query head ``h`` reads key/value head ``h // group``);
- ``cu_seqlens_q`` / ``cu_seqlens_k``: int tensors [num_docs + 1], document ``d`` owns query
  tokens ``cu_seqlens_q[d]:cu_seqlens_q[d+1]`` and key tokens ``cu_seqlens_k[d]:cu_seqlens_k[d+1]``;
- ``q_positions`` [total_q] / ``k_positions`` [total_k] (optional ints): under ``causal`` a query
  attends a key iff they are in the same document and ``k_pos <= q_pos``; without positions a
  token's position is its index inside its document (top-left aligned, like SDPA ``is_causal``);
- ``window`` (optional int W >= 1, causal only): a query also needs ``k_pos > q_pos - W``, the
  last W positions including itself (transformers' ``sliding_window_overlay``:
  ``kv_idx > q_idx - sliding_window``);
- ``sinks`` (optional [heads_q] logits, in the units of the scaled scores): one extra column per
  row that joins the softmax denominator but carries no value (gpt-oss);
- ``lse`` [heads_q, total_q]: natural-log softmax normaliser, fp32 (fp64 for fp64 inputs), the sink
  included; a row that sees no key has ``out = 0`` and ``lse = -inf`` (``lse = sink`` with sinks).

Why a loop over documents rather than one big masked matrix: memory stays O(doc_len²) instead of
O(total²), so the reference also serves CPU ring attention on longer packed sequences.
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _doc_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    return [(cq[d], cq[d + 1], ck[d], ck[d + 1]) for d in range(len(cq) - 1)]


def _doc_scores(q_doc, k_doc, q_pos, k_pos, causal: bool, softmax_scale: float, group: int, window=None):
    """Masked scores [heads_q, len_q, len_k] in the compute dtype for one document."""
    dtype = _compute_dtype(q_doc)
    qh = q_doc.to(dtype).transpose(0, 1)  # [heads_q, len_q, d]
    kh = k_doc.to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)  # [heads_q, len_k, d]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * softmax_scale
    if causal:
        allowed = k_pos[None, :] <= q_pos[:, None]  # [len_q, len_k]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _doc_positions(positions, start: int, end: int, device) -> torch.Tensor:
    if positions is None:
        return torch.arange(end - start, device=device)
    return positions[start:end].to(torch.int64)


def _safe_lse(lse: torch.Tensor) -> torch.Tensor:
    # Rows that see no key have lse = -inf; subtracting 0 instead keeps exp(-inf - lse) = 0, not NaN.
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [total_q, heads_q, head_dim_v] in q.dtype, lse [heads_q, total_q])``; no autograd."""
    total_q, heads_q, _ = q.shape
    group = heads_q // k.shape[1]
    dtype = _compute_dtype(q)
    out = torch.zeros(total_q, heads_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((heads_q, total_q), float("-inf"), dtype=dtype, device=q.device)
    sink_col = None
    if sinks is not None:
        sink_col = sinks.to(device=q.device, dtype=dtype)[:, None, None]  # [heads_q, 1, 1]
        lse.copy_(sink_col[:, :, 0].expand(heads_q, total_q))  # rows that see no key: lse = sink
    for qs, qe, ks, ke in _doc_bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs:
            continue
        q_pos = _doc_positions(q_positions, qs, qe, q.device)
        k_pos = _doc_positions(k_positions, ks, ke, q.device)
        scores = _doc_scores(q[qs:qe], k[ks:ke], q_pos, k_pos, causal, softmax_scale, group, window)
        if sink_col is not None:  # the sink joins the denominator as one more (value-less) column
            lse_doc = torch.logsumexp(torch.cat([scores, sink_col.expand(-1, qe - qs, 1)], -1), dim=-1)
        else:
            lse_doc = torch.logsumexp(scores, dim=-1)  # [heads_q, len_q]; -inf where no key is visible
        probs = torch.exp(scores - _safe_lse(lse_doc)[..., None])
        vh = v[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        out[qs:qe] = torch.matmul(probs, vh).transpose(0, 1).to(q.dtype)
        lse[:, qs:qe] = lse_doc
    return out, lse


def reference_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in the compute dtype (fp32, fp64 for fp64 inputs).

    Sinks need nothing here: ``lse`` already includes them, and their own gradient is
    ``sink_grad(lse, delta, sinks)`` (attention/sinks.py).

    ``lse`` [heads_q, total_q] and ``delta`` [heads_q, total_q] may be global quantities of a larger
    attention (ring attention: lse after merging every step, delta = rowsum(dO·O) - dlse of the
    merged output); the formulas P = exp(S - lse), dS = P ∘ (dP - delta) hold per key block.
    """
    group = q.shape[1] // k.shape[1]
    dtype = _compute_dtype(q)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    for qs, qe, ks, ke in _doc_bounds(cu_seqlens_q, cu_seqlens_k):
        if qe == qs or ke == ks:
            continue
        q_pos = _doc_positions(q_positions, qs, qe, q.device)
        k_pos = _doc_positions(k_positions, ks, ke, q.device)
        scores = _doc_scores(q[qs:qe], k[ks:ke], q_pos, k_pos, causal, softmax_scale, group, window)
        probs = torch.exp(scores - _safe_lse(lse[:, qs:qe].to(dtype))[..., None])  # [hq, lq, lk]
        doh = do[qs:qe].to(dtype).transpose(0, 1)  # [hq, lq, d]
        qh = q[qs:qe].to(dtype).transpose(0, 1)
        kh = k[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        vh = v[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        dp = torch.matmul(doh, vh.transpose(1, 2))
        ds = probs * (dp - delta[:, qs:qe].to(dtype)[..., None])
        dq[qs:qe] = (torch.matmul(ds, kh) * softmax_scale).transpose(0, 1)
        dk_h = torch.matmul(ds.transpose(1, 2), qh) * softmax_scale  # [hq, lk, d]
        dv_h = torch.matmul(probs.transpose(1, 2), doh)
        heads_kv, len_k = k.shape[1], ke - ks
        # Sum the group of query heads that share one key/value head.
        dk[ks:ke] = dk_h.view(heads_kv, group, len_k, -1).sum(1).transpose(0, 1)
        dv[ks:ke] = dv_h.view(heads_kv, group, len_k, -1).sum(1).transpose(0, 1)
    return dq, dk, dv


def reference_bwd_preprocess(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO · O) in fp32 (fp64 for fp64 inputs), heads before tokens.

    [total, heads, d] -> [heads, total]; [batch, seq, heads, d] -> [batch, heads, seq].
    """
    dtype = _compute_dtype(out)
    return (out.to(dtype) * do.to(dtype)).sum(-1).transpose(-1, -2).contiguous()
