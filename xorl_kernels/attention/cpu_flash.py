"""Flash attention on CPU tensors through torch's own CPU flash kernel, on the packed form.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (forward, returns the log-sum-exp) and its
``_backward`` tile the scores the way the GPU kernels do, so no [heads, len_q, len_k] score matrix is
ever held; the plain-torch reference (attention/reference.py) materialises one per document and
stays the oracle the tests hold this path to. What the kernel takes natively: [batch, heads,
seq, head_dim] strided views (the packed [total, heads, d] tensors are viewed, not copied), GQA
(heads_q a multiple of heads_kv, query head h reads key/value head h // group), top-left causal
(SDPA's ``is_causal``), a float additive mask, an explicit softmax scale, fp16 / bf16 / fp32 (fp64
too, but the automatic pick keeps fp64 on the reference: that is the oracle's dtype).

Everything else of the op's contract is expressed on top of it, per call:

- packed documents: one kernel call for documents of equal lengths (a batch; a batched layout is
  one), else one call per document (memory stays per document, like the reference);
- positions and sliding windows: an additive mask [len_q, len_k] per call (only where the
  positions do not reduce to plain causal or to no mask at all); rows that see no key come back
  with out = 0 and lse = -inf (the kernel reports lse = 0 for them);
- head_dim_v != head_dim_qk (MLA): the narrower side is zero-padded to the wider, which changes no
  score and no output column;
- sinks: the forward runs without them and ``apply_sinks`` folds them in (lse' = logaddexp(lse,
  sink)); the backward needs nothing more, its lse already holds them (attention/sinks.py);
- the backward's ``delta``: the kernel derives it from ``out`` (rowsum(dO·O)). When the given delta
  is exactly that (a loss through out only, a ring backward, whose delta is the merged output's),
  ``out`` goes in as is; otherwise (a loss through lse too: delta = rowsum(dO·O) - dlse) delta is
  written into one spare value column: v' = [v, 0], dO' = [dO, 1], O' = [0, delta], so
  rowsum(dO'·O') = delta while dO'·v'^T = dO·v^T; that call runs in fp32 (delta is fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xorl_kernels.attention.layout import Packed

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass
class _Call:
    """One kernel call: ``count`` consecutive documents of equal lengths from token qs / ks on."""

    qs: int
    ks: int
    count: int
    len_q: int
    len_k: int
    is_causal: bool = False
    mask: torch.Tensor | None = None  # additive [len_q, len_k], shared by the call's documents
    empty_rows: torch.Tensor | None = None  # bool [len_q]: rows that see no key (with a mask only)


def _positions(positions: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    if positions is None:
        return torch.arange(end - start, device="cpu")
    return positions[start:end].to(torch.int64)


def _mask_of(p: Packed, call: _Call, dtype: torch.dtype) -> _Call:
    """The call's masking: none, the kernel's own causal, or an additive mask from the positions."""
    if not p.causal:
        return call
    if p.q_positions is None and p.window is None:
        call.is_causal = True  # top-left causal on in-document indices: the kernel's is_causal
        return call
    q_pos = _positions(p.q_positions, call.qs, call.qs + call.len_q)
    k_pos = _positions(p.k_positions, call.ks, call.ks + call.len_k)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if p.window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - p.window
    if bool(allowed.all()):
        return call  # every key visible (a ring step with keys wholly before the queries)
    if torch.equal(allowed, torch.ones_like(allowed).tril()):
        call.is_causal = True  # ascending positions on both sides: plain causal, the kernel skips tiles
        return call
    call.mask = torch.zeros(allowed.shape, dtype=dtype, device="cpu").masked_fill_(~allowed, float("-inf"))
    empty = ~allowed.any(-1)
    call.empty_rows = empty if bool(empty.any()) else None
    return call


def _same_positions(positions: torch.Tensor | None, start: int, count: int, length: int) -> bool:
    if positions is None or count == 1:
        return True
    rows = positions[start:start + count * length].view(count, length)
    return bool((rows == rows[:1]).all())


def _calls(p: Packed, dtype: torch.dtype) -> list[_Call]:
    """The kernel calls covering every document with a query and a key (others stay 0 / -inf)."""
    cq, ck = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
    lens_q = [cq[d + 1] - cq[d] for d in range(len(cq) - 1)]
    lens_k = [ck[d + 1] - ck[d] for d in range(len(ck) - 1)]
    count = len(lens_q)
    uniform = len(set(lens_q)) == 1 and len(set(lens_k)) == 1
    if uniform and _same_positions(p.q_positions, 0, count, lens_q[0]) and _same_positions(
        p.k_positions, 0, count, lens_k[0]
    ):
        docs = [_Call(0, 0, count, lens_q[0], lens_k[0])]
    else:
        docs = [_Call(cq[d], ck[d], 1, lens_q[d], lens_k[d]) for d in range(count)]
    return [_mask_of(p, call, dtype) for call in docs if call.len_q and call.len_k]


def _heads_first(x: torch.Tensor, start: int, count: int, length: int) -> torch.Tensor:
    """Packed rows [start, start + count·length) as the kernel's [count, heads, length, d] view."""
    return x[start:start + count * length].view(count, length, *x.shape[1:]).transpose(1, 2)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """The kernel's [count, heads, length, d] back to packed [count·length, heads, d]."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])


def _pad(x: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = x if dtype is None else x.to(dtype)
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def cpu_flash_forward(p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [total_q, heads_q, d_v] in q's dtype, lse [heads_q, total_q] fp32, fp64 for fp64), sinks
    included; no autograd."""
    total_q, heads_q, d_v = p.q.shape[0], p.q.shape[1], p.v.shape[-1]
    width = max(p.q.shape[-1], d_v)
    q, k, v = _pad(p.q, width), _pad(p.k, width), _pad(p.v, width)
    lse_dtype = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    calls = _calls(p, q.dtype)
    whole = len(calls) == 1 and calls[0].count * calls[0].len_q == total_q
    if not whole:
        out = torch.zeros(total_q, heads_q, d_v, dtype=p.q.dtype, device="cpu")
        lse = torch.full((heads_q, total_q), float("-inf"), dtype=lse_dtype, device="cpu")
    for call in calls:
        rows = slice(call.qs, call.qs + call.count * call.len_q)
        o, l = _FORWARD(
            _heads_first(q, call.qs, call.count, call.len_q), _heads_first(k, call.ks, call.count, call.len_k),
            _heads_first(v, call.ks, call.count, call.len_k), 0.0, call.is_causal, attn_mask=call.mask,
            scale=p.softmax_scale,
        )
        o_packed = _tokens_first(o)[..., :d_v]
        l_packed = l.transpose(0, 1).reshape(heads_q, -1).to(lse_dtype)  # [count, heads, len] -> [heads, total]
        if call.empty_rows is not None:
            l_packed[:, call.empty_rows.repeat(call.count)] = float("-inf")
        if whole:
            out, lse = o_packed.contiguous(), l_packed.contiguous()
        else:
            out[rows], lse[:, rows] = o_packed, l_packed
    if p.sinks is not None:
        from xorl_kernels.attention.sinks import apply_sinks

        out, lse = apply_sinks(out, lse, p.sinks)
    return out, lse


def _delta_of(out: torch.Tensor | None, do: torch.Tensor) -> torch.Tensor | None:
    if out is None:
        return None
    from xorl_kernels.attention.reference import reference_bwd_preprocess

    return reference_bwd_preprocess(out, do)


def cpu_flash_backward(
    p: Packed, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in packed shapes given the (possibly global) lse and delta [heads_q, total_q];
    fp32 for fp32 / fp16 / bf16 inputs (fp64 for fp64). ``out`` (optional): the output delta may
    have been computed from, which lets the kernel run on the inputs' own dtype and width."""
    d_qk, d_v = p.q.shape[-1], p.v.shape[-1]
    own = _delta_of(out, do)
    if own is not None and own.dtype == delta.dtype and torch.equal(own, delta):
        dtype = p.q.dtype
        width = max(d_qk, d_v)
        out_k, do_k = _pad(out, width), _pad(do, width)
    else:  # delta in a spare value column (see the module docstring), in fp32
        dtype = torch.float64 if p.q.dtype == torch.float64 else torch.float32
        width = max(d_qk, d_v + 1)
        out_k = torch.zeros(*do.shape[:-1], width, dtype=dtype, device="cpu")
        out_k[..., d_v] = delta.transpose(0, 1)
        do_k = _pad(do, width, dtype)
        do_k[..., d_v] = 1.0
    q, k, v = _pad(p.q, width, dtype), _pad(p.k, width, dtype), _pad(p.v, width, dtype)
    grad_dtype = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    # Rows that see no key anywhere have lse = -inf; 0 there keeps exp(-inf - lse) = 0, never NaN.
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(grad_dtype)
    dq = torch.zeros(p.q.shape, dtype=grad_dtype, device="cpu")
    dk = torch.zeros(p.k.shape, dtype=grad_dtype, device="cpu")
    dv = torch.zeros(p.v.shape, dtype=grad_dtype, device="cpu")
    for call in _calls(p, dtype):
        q_rows = slice(call.qs, call.qs + call.count * call.len_q)
        k_rows = slice(call.ks, call.ks + call.count * call.len_k)
        lse_call = lse[:, q_rows].reshape(-1, call.count, call.len_q).transpose(0, 1)  # [count, heads, len]
        gq, gk, gv = _BACKWARD(
            _heads_first(do_k, call.qs, call.count, call.len_q), _heads_first(q, call.qs, call.count, call.len_q),
            _heads_first(k, call.ks, call.count, call.len_k), _heads_first(v, call.ks, call.count, call.len_k),
            _heads_first(out_k, call.qs, call.count, call.len_q), lse_call.contiguous(), 0.0, call.is_causal,
            attn_mask=call.mask, scale=p.softmax_scale,
        )
        dq[q_rows] = _tokens_first(gq)[..., :d_qk]
        dk[k_rows] = _tokens_first(gk)[..., :d_qk]
        dv[k_rows] = _tokens_first(gv)[..., :d_v]
    return dq, dk, dv
