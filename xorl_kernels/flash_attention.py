"""Flash attention with log-sum-exp: public functions, autograd and backend dispatch.

Public (differentiable w.r.t. q, k, v):

    out = flash_attn(q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, ...)
    out, lse = flash_attn_with_lse(q, k, v, ...)   # the loss may depend on lse too

Lower level, no autograd (what ring attention calls once per step):

    out, lse = flash_attn_forward(q, k, v, ...)
    delta = flash_attn_bwd_preprocess(out, do)     # rowsum(dO·O) fp32, once per backward
    dq, dk, dv = flash_attn_backward(do, q, k, v, out, lse, delta, ...,
                                     dq_accum=None, dk_accum=None, dv_accum=None)

Layouts
-------
- Batched: q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k, heads_kv, head_dim];
  lse / delta fp32 [batch, heads_q, seq_q].
- Packed documents (``cu_seqlens`` or ``cu_seqlens_q``/``cu_seqlens_k`` given): batch must be 1,
  q [1, total_q, heads_q, head_dim] (lse [1, heads_q, total_q]) or, flash-attn style,
  q [total_q, heads_q, head_dim] (lse [heads_q, total_q]). ``cu_seqlens*`` are int32/int64
  [num_docs + 1] starting at 0 and ending at the total; the q side and k side may differ in
  length per document (``cu_seqlens`` sets both). Pass ``max_seqlen`` (or ``max_seqlen_q`` /
  ``max_seqlen_k``) to avoid a device sync when the Triton backend sizes its grid; it must be
  at least the longest document (a smaller value leaves rows unwritten). On CUDA the values of
  cu_seqlens and positions are not validated (that would sync the device on every call);
  positions must fit in int32.
- GQA/MQA: heads_kv divides heads_q; query head h reads key/value head h // (heads_q // heads_kv).
- fp16, bf16 and fp32 on every backend; fp64 only on the reference backend (its lse is fp64).

Masking
-------
Tokens only attend inside their document. With ``causal=True`` a query attends a key iff
``k_pos <= q_pos``. Positions default to the index inside the document (top-left aligned, like
SDPA ``is_causal``). ``q_positions`` [total_q] / ``k_positions`` [total_k] (int32/int64) override
them — e.g. a zig-zag ring step holds two runs of each document per rank, and one call with
their true positions computes both halves. In the batched layout positions may also be [seq]
(shared by every batch row). A row that sees no key gets out = 0 and lse = -inf (never NaN),
and its gradients are finite (zero). Without ``causal`` positions are ignored (documents still
separate tokens).

Cost: the Triton kernels derive each block's loop bounds from the positions, so keys visible to
every row of a query block run mask-free and keys visible to none are never read. Any positions
are correct; positions ascending inside each document (zig-zag shards are) make the masked part
just the diagonal, so the P² steps of a zig-zag ring visit exactly the tiles of one monolithic
causal attention (when chunk lengths are multiples of the block sizes).

Gradients through lse
---------------------
With P = softmax(S), d lse_i / d S_ij = P_ij, so a loss that depends on lse only changes the
backward's delta: dS = P ∘ (dP - (rowsum(dO·O) - dlse)). The autograd path does this for you; a
ring backward passes ``delta = flash_attn_bwd_preprocess(out, dout) - dlse`` (global out/lse of
the merged attention) to every step's ``flash_attn_backward``.

Accumulators
------------
``flash_attn_backward`` adds into ``dq_accum`` / ``dk_accum`` / ``dv_accum`` when given (fp32,
contiguous, same shape as q / k / v) and returns them; otherwise it returns fresh gradients in
the dtype of q / k / v. Ring attention keeps one fp32 dq buffer across steps and passes fresh
(or per-step) dk/dv buffers as it rotates them.

Dispatch
--------
``backend=None``: CUDA tensors -> Triton, CPU tensors -> plain-torch reference;
``XORL_FORCE_REFERENCE=1`` forces the reference. ``backend="triton"`` forces Triton (on CPU this
needs ``TRITON_INTERPRET=1`` set before triton is imported), ``backend="reference"`` the reference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .flash_attn_reference import reference_backward, reference_bwd_preprocess, reference_forward

_BACKENDS = (None, "triton", "reference")
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Packed:
    """One call normalised to the packed form every backend works on (see flash_attn_reference)."""

    q: torch.Tensor  # [total_q, heads_q, head_dim]
    k: torch.Tensor  # [total_k, heads_kv, head_dim]
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [num_docs + 1]
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    q_positions: torch.Tensor | None  # int [total_q]
    k_positions: torch.Tensor | None
    causal: bool
    softmax_scale: float
    layout: str  # "batched", "packed4d" or "packed3d": how to give results back
    batch: int
    seq_q: int


# -- input normalisation -------------------------------------------------------------------------


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int tensor [num_docs + 1], got {cu!r}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}; cast it with .int()")
    cu = cu.to(device=device, dtype=torch.int32)
    if cu.is_cuda:
        # Value checks would cost a device sync per call (ring attention calls once per step).
        return cu
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {first}..{last}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    return cu


def _check_positions(name: str, pos, total: int, batch: int, per_row: int, device) -> torch.Tensor | None:
    if pos is None:
        return None
    if pos.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {pos.dtype}")
    pos = pos.to(device).reshape(-1)
    if batch > 1 and pos.numel() == per_row:
        pos = pos.repeat(batch)
    if pos.numel() != total:
        raise ValueError(f"{name} must have one entry per token ({total}), got shape {tuple(pos.shape)}")
    # The kernels keep positions in int32 (and use +-(2**31 - 1) as padding sentinels).
    if pos.dtype == torch.int64 and not pos.is_cuda and pos.numel() and int(pos.abs().max()) >= 2**31 - 1:
        raise ValueError(f"{name} must fit in int32 (|pos| < 2**31 - 1)")
    return pos.to(torch.int32)


def _pack(
    q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, q_positions, k_positions,
) -> _Packed:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use float16, bfloat16, float32 (or float64)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        raise ValueError(
            "q, k, v must all be [batch, seq, heads, head_dim] (or [total, heads, head_dim] with "
            f"cu_seqlens), got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads of k/v ({heads_kv}) must divide heads of q ({heads_q}) for GQA/MQA")

    if cu_seqlens is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("pass either cu_seqlens (both sides) or cu_seqlens_q/cu_seqlens_k, not both")
        cu_seqlens_q = cu_seqlens_k = cu_seqlens
        max_seqlen_q = max_seqlen_k = max_seqlen
    elif max_seqlen is not None:
        max_seqlen_q = max_seqlen_q if max_seqlen_q is not None else max_seqlen
        max_seqlen_k = max_seqlen_k if max_seqlen_k is not None else max_seqlen
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (or use cu_seqlens)")

    device = q.device
    if not varlen:
        if q.dim() != 4:
            raise ValueError("3-D q/k/v ([total, heads, head_dim]) need cu_seqlens; batched input is 4-D")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
        batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq_q
        cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq_k
        max_q, max_k, layout = seq_q, seq_k, "batched"
        qp, kp, vp = (t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v))
    else:
        if q.dim() == 4:
            if q.shape[0] != 1 or k.shape[0] != 1:
                raise ValueError(
                    f"with cu_seqlens the batch must be 1 (documents packed along seq), got {q.shape[0]}"
                )
            qp, kp, vp, layout = q[0], k[0], v[0], "packed4d"
        else:
            qp, kp, vp, layout = q, k, v, "packed3d"
        cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, qp.shape[0], device)
        cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, kp.shape[0], device)
        if cu_q.numel() != cu_k.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must list the same documents, got {cu_q.numel() - 1} "
                f"and {cu_k.numel() - 1}"
            )
        batch, seq_q, seq_k = 1, qp.shape[0], kp.shape[0]
        max_q, max_k = max_seqlen_q, max_seqlen_k
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q_pos = _check_positions("q_positions", q_positions, qp.shape[0], batch, seq_q, device)
    k_pos = _check_positions("k_positions", k_positions, kp.shape[0], batch, seq_k, device)
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_positions and k_positions must be given together")
    return _Packed(
        qp, kp, vp, cu_q, cu_k, max_q, max_k, q_pos, k_pos, bool(causal), float(softmax_scale),
        layout, batch, seq_q,
    )


def _out_to_public(out: torch.Tensor, p: _Packed) -> torch.Tensor:
    if p.layout == "batched":
        return out.view(p.batch, p.seq_q, *out.shape[1:])
    return out.unsqueeze(0) if p.layout == "packed4d" else out


def _lse_to_public(lse: torch.Tensor, p: _Packed) -> torch.Tensor:
    """[heads, total_q] -> [batch, heads, seq_q] / [1, heads, total_q] / [heads, total_q]."""
    if p.layout == "batched":
        return lse.view(lse.shape[0], p.batch, p.seq_q).transpose(0, 1).contiguous()
    return lse.unsqueeze(0) if p.layout == "packed4d" else lse


def _lse_to_packed(name: str, lse: torch.Tensor, p: _Packed) -> torch.Tensor:
    heads = p.q.shape[1]
    expected = {"batched": (p.batch, heads, p.seq_q), "packed4d": (1, heads, p.seq_q)}.get(
        p.layout, (heads, p.seq_q)
    )
    if tuple(lse.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for this layout, got {tuple(lse.shape)}")
    if p.layout == "batched":
        return lse.transpose(0, 1).reshape(heads, -1)
    return lse[0] if p.layout == "packed4d" else lse


def _grad_to_packed(name: str, t: torch.Tensor | None, like: torch.Tensor, packed_like: torch.Tensor):
    if t is None:
        return None
    if t.shape != like.shape or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 tensor of shape {tuple(like.shape)}, "
            f"got {t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})"
        )
    return t.view(packed_like.shape)


# -- dispatch -------------------------------------------------------------------------------------


def _use_triton(backend: str | None, x: torch.Tensor) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend is not None:
        use = backend == "triton"
    elif os.environ.get("XORL_FORCE_REFERENCE", "0") not in ("", "0"):
        use = False
    else:
        use = x.is_cuda
    if use and x.dtype == torch.float64:
        raise TypeError("the Triton backend supports float16/bfloat16/float32; use backend='reference' for float64")
    return use


def _max_seqlen(given: int | None, cu: torch.Tensor) -> int:
    if given is not None:
        return int(given)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _forward_packed(p: _Packed, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(backend, p.q):
        from .flash_attn_fwd_triton import triton_forward

        return triton_forward(
            p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k,
            _max_seqlen(p.max_seqlen_q, p.cu_seqlens_q), _max_seqlen(p.max_seqlen_k, p.cu_seqlens_k),
            p.causal, p.softmax_scale, p.q_positions, p.k_positions,
        )
    out, lse = reference_forward(
        p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k, p.causal, p.softmax_scale,
        p.q_positions, p.k_positions,
    )
    return out, lse if p.q.dtype == torch.float64 else lse.float()


def _backward_packed(p: _Packed, do, lse, delta, dq_acc, dk_acc, dv_acc, backend):
    """Gradients into the given packed fp32 accumulators (added) or fresh tensors (q/k/v dtype)."""
    if _use_triton(backend, p.q):
        from .flash_attn_bwd_triton import triton_backward

        return triton_backward(
            do, p.q, p.k, p.v, lse, delta, p.cu_seqlens_q, p.cu_seqlens_k,
            _max_seqlen(p.max_seqlen_q, p.cu_seqlens_q), _max_seqlen(p.max_seqlen_k, p.cu_seqlens_k),
            p.causal, p.softmax_scale, p.q_positions, p.k_positions, dq_acc, dk_acc, dv_acc,
        )
    grads = reference_backward(
        do, p.q, p.k, p.v, lse, delta, p.cu_seqlens_q, p.cu_seqlens_k, p.causal, p.softmax_scale,
        p.q_positions, p.k_positions,
    )
    result = []
    for grad, acc, like in zip(grads, (dq_acc, dk_acc, dv_acc), (p.q, p.k, p.v)):
        result.append(acc.add_(grad) if acc is not None else grad.to(like.dtype))
    return tuple(result)


# -- lower-level API (no autograd) ---------------------------------------------------------------


def flash_attn_forward(
    q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) without autograd; arguments and layouts as in the module docstring."""
    p = _pack(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, q_positions, k_positions)
    with torch.no_grad():
        out, lse = _forward_packed(p, backend)
    return _out_to_public(out, p), _lse_to_public(lse, p)


def flash_attn_bwd_preprocess(out: torch.Tensor, do: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """delta = rowsum(dO·O) in fp32, in lse layout ([batch, heads, seq] or [heads, total]).

    Triton (CUDA): one pass over out/do with no fp32 temporaries; reference: plain torch
    (fp64 for fp64 inputs).
    """
    if out.shape != do.shape:
        raise ValueError(f"out and do must have the same shape, got {tuple(out.shape)} and {tuple(do.shape)}")
    if out.dim() not in (3, 4):
        raise ValueError(f"out must be [batch, seq, heads, head_dim] or [total, heads, head_dim], got {out.dim()}-D")
    if out.dtype != torch.float64 and do.dtype != torch.float64 and _use_triton(backend, out):
        from .flash_attn_bwd_triton import triton_bwd_preprocess

        return triton_bwd_preprocess(out, do)
    return reference_bwd_preprocess(out, do)


def flash_attn_backward(
    do, q, k, v, out, lse, delta, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, dq_accum=None, dk_accum=None, dv_accum=None, backend=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for one attention call given the (possibly global) lse and delta.

    ``out`` is only checked for shape (delta already carries what the backward needs from it).
    Accumulators, when given, are added into and returned (see the module docstring).
    """
    p = _pack(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, q_positions, k_positions)
    if do.shape != q.shape or (out is not None and out.shape != q.shape):
        raise ValueError(f"do and out must have q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    lse_p = _lse_to_packed("lse", lse, p)
    delta_p = _lse_to_packed("delta", delta, p)
    do_p = _out_to_packed(do, p)
    accs = (
        _grad_to_packed("dq_accum", dq_accum, q, p.q),
        _grad_to_packed("dk_accum", dk_accum, k, p.k),
        _grad_to_packed("dv_accum", dv_accum, v, p.v),
    )
    with torch.no_grad():
        dq, dk, dv = _backward_packed(p, do_p, lse_p, delta_p, *accs, backend)
    return tuple(
        acc if acc is not None else g.view(like.shape)
        for g, acc, like in zip((dq, dk, dv), (dq_accum, dk_accum, dv_accum), (q, k, v))
    )


def _out_to_packed(t: torch.Tensor, p: _Packed) -> torch.Tensor:
    if p.layout == "batched":
        return t.reshape(-1, *t.shape[2:])
    return t[0] if p.layout == "packed4d" else t


# -- autograd ------------------------------------------------------------------------------------


class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kwargs: dict):
        backend = kwargs.pop("backend")
        out, lse = flash_attn_forward(q, k, v, backend=backend, **kwargs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kwargs, ctx.backend = kwargs, backend
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        dout = torch.zeros_like(out) if dout is None else dout
        delta = flash_attn_bwd_preprocess(out, dout, backend=ctx.backend)
        if dlse is not None:
            delta = delta - dlse.to(delta.dtype)
        dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, delta, backend=ctx.backend, **ctx.kwargs)
        return dq, dk, dv, None


def flash_attn_with_lse(
    q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse), differentiable w.r.t. q, k, v through both outputs. See the module docstring."""
    kwargs = dict(
        causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, q_positions=q_positions, k_positions=k_positions, backend=backend,
    )
    return _FlashAttnFunction.apply(q, k, v, kwargs)


def flash_attn(
    q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, backend=None,
) -> torch.Tensor:
    """Attention output [batch, seq_q, heads_q, head_dim] (or packed); see the module docstring."""
    out, _ = flash_attn_with_lse(
        q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        q_positions=q_positions, k_positions=k_positions, backend=backend,
    )
    return out
