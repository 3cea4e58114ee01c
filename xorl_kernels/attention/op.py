"""Flash attention with log-sum-exp: public functions, autograd and backend dispatch.

Public (differentiable w.r.t. q, k, v):

    out = flash_attn(q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, ...)
    out, lse = flash_attn_with_lse(q, k, v, ...)   # the loss may depend on lse too

Lower level, no autograd (what ring attention calls once per step):

    out, lse = flash_attn_forward(q, k, v, ...)
    delta = flash_attn_bwd_preprocess(out, do)     # rowsum(dO·O) fp32, once per backward
    dq, dk, dv = flash_attn_backward(do, q, k, v, out, lse, delta, ...,
                                     dq_accum=None, dk_accum=None, dv_accum=None)
    dsinks = sink_grad(lse, delta, sinks)          # attention/sinks.py, with apply_sinks

Layouts
-------
- Batched: q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k, heads_kv, head_dim];
  lse / delta fp32 [batch, heads_q, seq_q]. v may have its own head dim (MLA: q·k 192, v 128);
  out, dout and dv then have v's head dim (everything else below holds for either dim).
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

Sliding window: ``window=W`` (causal only; non-causal raises) also needs ``k_pos > q_pos - W``:
a query sees the last W positions of its document, itself included (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). With a window, positions must be
non-decreasing inside each document (zig-zag shards are; the Triton kernels search them for their
bounds; checked for CPU tensors).

Sinks: ``sinks`` [heads_q] (float, learned logits in the units of the scaled scores) join every
row's softmax denominator without a value (gpt-oss); the returned lse includes them, and a row
that sees no key gets out = 0, lse = sink. Under autograd ``sinks`` gets its gradient;
``flash_attn_backward(..., sinks=s)`` returns (dq, dk, dv, dsinks). Ring attention runs its steps
without sinks and applies them once per row after the merge (attention/sinks.py).

Cost: the Triton kernels derive each block's loop bounds from the positions, so keys visible to
every row of a query block run mask-free and keys visible to none are never read. Without a
window any positions are correct; positions ascending inside each document (zig-zag shards are) make the masked part
just the diagonal, so the P² steps of a zig-zag ring visit exactly the tiles of one monolithic
causal attention (when chunk lengths are multiples of the block sizes). A window adds lower
bounds from the positions the same way: tiles wholly before every row's window are never read,
so a windowed attention costs about S·W, not S² (tests/unit/kernels/test_attention_features.py audits the
tile counts: common.count_tiles).

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
Through xorl_kernels.dispatch: ``backend=None``: CUDA tensors -> Triton, CPU tensors -> torch's
CPU flash kernel (attention/cpu_flash.py: every case above, never a whole score matrix), except
fp64, which stays on the plain-torch reference (attention/reference.py, the tests' oracle);
``XORL_FORCE_REFERENCE=1`` forces the reference. ``backend="triton"`` forces Triton (on CPU this
needs ``TRITON_INTERPRET=1`` set before triton is imported), ``backend="torch_cpu"`` torch's CPU
kernel (CPU tensors, any dtype), ``backend="reference"`` the reference. Input normalisation:
attention/layout.py.
"""

from __future__ import annotations

import torch

from xorl_kernels.attention.cpu_flash import cpu_flash_backward, cpu_flash_forward
from xorl_kernels.attention.layout import (
    Packed,
    grad_to_packed,
    lse_to_packed,
    lse_to_public,
    out_to_packed,
    out_to_public,
    pack,
)
from xorl_kernels.attention.reference import reference_backward, reference_bwd_preprocess, reference_forward
from xorl_kernels.attention.sinks import apply_sinks, sink_grad
from xorl_kernels.dispatch import REFERENCE, TORCH_CPU, TRITON, pick_backend
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

__all__ = [
    "apply_sinks",
    "flash_attn",
    "flash_attn_backward",
    "flash_attn_bwd_preprocess",
    "flash_attn_forward",
    "flash_attn_with_lse",
    "sink_grad",
]

_AVAILABLE = (TRITON, TORCH_CPU, REFERENCE)


# -- dispatch -------------------------------------------------------------------------------------


def _backend(backend: str | None, x: torch.Tensor) -> str:
    """The backend of one call. The automatic pick keeps fp64 on the reference (the tests' oracle;
    torch's CPU kernel would take it too)."""
    chosen = pick_backend("flash_attn", [x], _AVAILABLE, backend)
    if chosen == TRITON and x.dtype == torch.float64:
        raise TypeError("the Triton backend supports float16/bfloat16/float32; use backend='reference' for float64")
    if chosen == TORCH_CPU:
        if x.is_cuda:
            raise ValueError("backend='torch_cpu' is torch's CPU flash kernel: it takes CPU tensors")
        if backend is None and x.dtype == torch.float64:
            return REFERENCE
    return chosen


def _max_seqlen(given: int | None, cu: torch.Tensor) -> int:
    if given is not None:
        return int(given)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _forward_packed(p: Packed, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = _backend(backend, p.q)
    if chosen == TRITON:
        from xorl_kernels.attention.fwd_triton import triton_forward

        return triton_forward(
            p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k,
            _max_seqlen(p.max_seqlen_q, p.cu_seqlens_q), _max_seqlen(p.max_seqlen_k, p.cu_seqlens_k),
            p.causal, p.softmax_scale, p.q_positions, p.k_positions, sinks=p.sinks, window=p.window,
        )
    if chosen == TORCH_CPU:
        return cpu_flash_forward(p)
    out, lse = reference_forward(
        p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k, p.causal, p.softmax_scale,
        p.q_positions, p.k_positions, sinks=p.sinks, window=p.window,
    )
    return out, lse if p.q.dtype == torch.float64 else lse.float()


def _backward_packed(p: Packed, do, lse, delta, dq_acc, dk_acc, dv_acc, backend, out=None):
    """Gradients into the given packed fp32 accumulators (added) or fresh tensors (q/k/v dtype).
    ``out`` (packed, optional): torch's CPU kernel uses it when delta is rowsum(dO·out)."""
    chosen = _backend(backend, p.q)
    if chosen == TRITON:
        from xorl_kernels.attention.bwd_triton import triton_backward

        return triton_backward(
            do, p.q, p.k, p.v, lse, delta, p.cu_seqlens_q, p.cu_seqlens_k,
            _max_seqlen(p.max_seqlen_q, p.cu_seqlens_q), _max_seqlen(p.max_seqlen_k, p.cu_seqlens_k),
            p.causal, p.softmax_scale, p.q_positions, p.k_positions, dq_acc, dk_acc, dv_acc, window=p.window,
        )
    if chosen == TORCH_CPU:
        grads = cpu_flash_backward(p, do, lse, delta, out)
    else:
        grads = reference_backward(
            do, p.q, p.k, p.v, lse, delta, p.cu_seqlens_q, p.cu_seqlens_k, p.causal, p.softmax_scale,
            p.q_positions, p.k_positions, window=p.window,
        )
    result = []
    for grad, acc, like in zip(grads, (dq_acc, dk_acc, dv_acc), (p.q, p.k, p.v)):
        result.append(acc.add_(grad) if acc is not None else grad.to(like.dtype))
    return tuple(result)


# -- lower-level API (no autograd) ---------------------------------------------------------------


def flash_attn_forward(
    q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, sinks=None, window=None, backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) without autograd; arguments and layouts as in the module docstring."""
    p = pack(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, q_positions, k_positions, sinks=sinks, window=window)
    with torch.no_grad():
        out, lse = _forward_packed(p, backend)
    return out_to_public(out, p), lse_to_public(lse, p)


def flash_attn_bwd_preprocess(out: torch.Tensor, do: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """delta = rowsum(dO·O) in fp32, in lse layout ([batch, heads, seq] or [heads, total]).

    Triton (CUDA): one pass over out/do with no fp32 temporaries; reference: plain torch
    (fp64 for fp64 inputs).
    """
    if out.shape != do.shape:
        raise ValueError(f"out and do must have the same shape, got {tuple(out.shape)} and {tuple(do.shape)}")
    if out.dim() not in (3, 4):
        raise ValueError(f"out must be [batch, seq, heads, head_dim] or [total, heads, head_dim], got {out.dim()}-D")
    if out.dtype != torch.float64 and do.dtype != torch.float64 and _backend(backend, out) == TRITON:
        from xorl_kernels.attention.preprocess_triton import triton_bwd_preprocess

        return triton_bwd_preprocess(out, do)
    return reference_bwd_preprocess(out, do)


def flash_attn_backward(
    do, q, k, v, out, lse, delta, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, dq_accum=None, dk_accum=None, dv_accum=None,
    sinks=None, window=None, backend=None,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) for one attention call given the (possibly global) lse and delta.

    ``out`` is only checked for shape (delta already carries what the backward needs from it).
    Accumulators, when given, are added into and returned (see the module docstring). With
    ``sinks`` the result is (dq, dk, dv, dsinks): lse already includes the sinks, so dq/dk/dv are
    unchanged and dsinks = sink_grad(lse, delta, sinks) over this call's rows.
    """
    p = pack(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, q_positions, k_positions, sinks=sinks, window=window)
    out_shape = (*q.shape[:-1], v.shape[-1])
    if tuple(do.shape) != out_shape or (out is not None and tuple(out.shape) != out_shape):
        raise ValueError(f"do and out must have shape {out_shape} (q's, with v's head_dim), got {tuple(do.shape)}")
    lse_p = lse_to_packed("lse", lse, p)
    delta_p = lse_to_packed("delta", delta, p)
    do_p = out_to_packed(do, p)
    out_p = None if out is None else out_to_packed(out, p)
    accs = (
        grad_to_packed("dq_accum", dq_accum, q, p.q),
        grad_to_packed("dk_accum", dk_accum, k, p.k),
        grad_to_packed("dv_accum", dv_accum, v, p.v),
    )
    with torch.no_grad():
        dq, dk, dv = _backward_packed(p, do_p, lse_p, delta_p, *accs, backend, out=out_p)
        grads = tuple(
            acc if acc is not None else g.view(like.shape)
            for g, acc, like in zip((dq, dk, dv), (dq_accum, dk_accum, dv_accum), (q, k, v))
        )
        if p.sinks is not None:
            grads = (*grads, sink_grad(lse_p, delta_p, p.sinks))
    return grads


# -- autograd: the xorl::flash_attn custom op ----------------------------------------------------
# A torch.library custom op (with a fake implementation and a registered backward) rather than an
# autograd.Function, so that torch.compile traces a decoder block through attention without a
# graph break: the fake gives the output shapes, and the checks that read cu_seqlens on the host
# run inside the op, where the tensors are real.


def _lse_shape(q: torch.Tensor, packed: bool) -> tuple:
    heads = q.shape[-2]
    if not packed:
        return (q.shape[0], heads, q.shape[1])
    return (1, heads, q.shape[1]) if q.dim() == 4 else (heads, q.shape[0])


SELECTIVE_CHECKPOINT_SAVES.join("xorl::flash_attn")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::flash_attn", mutates_args=())
def _flash_attn_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    q_positions: torch.Tensor | None, k_positions: torch.Tensor | None, sinks: torch.Tensor | None,
    causal: bool, softmax_scale: float | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
    window: int | None, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_forward(
        q, k, v, causal, softmax_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, q_positions=q_positions,
        k_positions=k_positions, sinks=sinks, window=window, backend=backend,
    )


@_flash_attn_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, sinks, causal, softmax_scale,
      max_seqlen_q, max_seqlen_k, window, backend):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=lse_dtype)


@torch.library.custom_op("xorl::flash_attn_backward", mutates_args=())
def _flash_attn_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    q_positions: torch.Tensor | None, k_positions: torch.Tensor | None, sinks: torch.Tensor | None,
    causal: bool, softmax_scale: float | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
    window: int | None, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty without sinks (a custom op cannot return None).

    A loss through lse only changes delta (see "Gradients through lse")."""
    delta = flash_attn_bwd_preprocess(out, dout, backend=backend)
    if dlse is not None:
        delta = delta - dlse.to(delta.dtype)
    grads = flash_attn_backward(
        dout, q, k, v, out, lse, delta, causal, softmax_scale, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        q_positions=q_positions, k_positions=k_positions, sinks=sinks, window=window, backend=backend,
    )
    return grads if sinks is not None else (*grads, q.new_empty(0))


@_flash_attn_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, cu_q, cu_k, q_pos, k_pos, sinks, *args):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, q_pos, k_pos, sinks, *options = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, q_pos, k_pos, sinks)
    ctx.options = options


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *masks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.xorl.flash_attn_backward(
        dout.contiguous(), dlse, q, k, v, out, lse, *masks, *ctx.options
    )
    has_sinks = masks[-1] is not None
    return (dq, dk, dv, None, None, None, None, dsinks if has_sinks else None, *([None] * len(ctx.options)))


_flash_attn_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_with_lse(
    q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, sinks=None, window=None, backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse), differentiable w.r.t. q, k, v (and sinks) through both outputs. See the module docstring."""
    if cu_seqlens is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("pass either cu_seqlens (both sides) or cu_seqlens_q/cu_seqlens_k, not both")
        cu_seqlens_q = cu_seqlens_k = cu_seqlens
        max_seqlen_q = max_seqlen_k = max_seqlen
    elif max_seqlen is not None:
        max_seqlen_q = max_seqlen_q if max_seqlen_q is not None else max_seqlen
        max_seqlen_k = max_seqlen_k if max_seqlen_k is not None else max_seqlen
    scale = None if softmax_scale is None else float(softmax_scale)
    return torch.ops.xorl.flash_attn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, sinks, bool(causal), scale,
        _as_int(max_seqlen_q), _as_int(max_seqlen_k), _as_int(window), backend,
    )


def _as_int(value):
    """The op takes Python ints (or torch.compile's symbolic ones); a tensor is read once here."""
    return value if value is None or isinstance(value, (int, torch.SymInt)) else int(value)


def flash_attn(
    q, k, v, causal=False, softmax_scale=None, cu_seqlens=None, max_seqlen=None, *,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    q_positions=None, k_positions=None, sinks=None, window=None, backend=None,
) -> torch.Tensor:
    """Attention output [batch, seq_q, heads_q, head_dim_v] (or packed); see the module docstring."""
    out, _ = flash_attn_with_lse(
        q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        q_positions=q_positions, k_positions=k_positions, sinks=sinks, window=window, backend=backend,
    )
    return out
