"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3.5, Qwen3-Next), differentiable.

    out, final_state = gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                        output_final_state=False, cu_seqlens=None,
                                        use_qk_l2norm_in_kernel=False, chunk_size=None)

Per value head, with a [d_k, d_v] state S reset to ``initial_state`` (or zero) at every document start:

    S_t = exp(g_t) S_{t-1};   S_t += k_t (beta_t (v_t - S_t^T k_t))^T;   out_t = S_t^T (q_t * scale)

with q, k first L2-normalised (x / sqrt(|x|^2 + 1e-6)) when ``use_qk_l2norm_in_kernel`` (the
Qwen3.5 / Qwen3-Next layers pass True; the default False matches transformers' and fla's
signatures). Numerics and argument names follow transformers' torch_chunk_gated_delta_rule.

Layouts
-------
- q, k [batch, seq, heads_k, d_k]; v [batch, seq, heads_v, d_v]; g, beta [batch, seq, heads_v]
  (g is the log decay, <= 0: ``-exp(A_log) * softplus(a + dt_bias)``; beta = sigmoid(b)).
- GQA-style head sharing: heads_k divides heads_v and value head h reads key head
  h // (heads_v // heads_k) (``linear_num_key_heads`` < ``linear_num_value_heads``; transformers'
  repeat_interleave).
- Packed documents: ``cu_seqlens`` (int32/int64 [docs + 1], 0 .. seq) with batch 1; the state
  resets at every document start. The host reads cu_seqlens once per call (one device sync).
- ``initial_state`` [docs or batch, heads_v, d_k, d_v] (any float dtype): the state entering each
  document. ``final_state`` (the same shape, fp32; float64 for float64 inputs) is the state after
  each document's last token. Both carry gradients, which a context-parallel scan needs: the
  gradient of the incoming state is what a rank sends back to the one before it.
- out: v's shape in q's dtype. fp16 / bf16 / fp32 on every backend (all arithmetic and the state
  in fp32), float64 on the reference only.

The custom op ``xorl::gated_delta_rule`` always computes the final state (it is free); the public
function drops it unless asked. ``chunk_size`` is the tokens per chunk of the chunked algorithm; it
changes rounding only, never the result. None picks the backend's: 32 for Triton (16 or 32 may be
given: its dots need >= 16, and at 64 tokens the backward's kernels ask for up to 232 KiB of shared
memory at d_k = d_v = 128, over an H100's 227 KiB, where 32 needs at most 64 KiB in bf16 and 88 KiB
in fp32 (160 KiB at 256): compiled for sm_90 and read from the kernels' metadata), 64 for the
reference, as transformers (any size >= 1).

Context parallelism (a later branch builds on this): out and final_state are affine in
initial_state, and with v = 0 the op is linear in it. So a rank can run its shard from a zero state
(out_0, final_0), and once the incoming state S arrives, add the op's output on (q, k, v = 0, g,
beta, initial_state = S), which is exactly S's contribution to out and to the final state; run on
the identity (d_v = d_k) it gives the shard's state transition. The gradients flow back the same way,
through initial_state.

Dispatch (xorl_kernels.dispatch): Triton on CUDA tensors (gated_delta/fwd_triton.py,
bwd_triton.py), the plain-torch reference on CPU (gated_delta/reference.py), XORL_FORCE_REFERENCE
forces the reference, ``backend=`` picks one by name.
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting
from xorl_kernels.doc_chunks import check_cu_seqlens, doc_chunks
from xorl_kernels.gated_delta.reference import gated_delta_backward_reference, gated_delta_forward_reference
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

_OP = "gated_delta_rule"
_AVAILABLE = (TRITON, REFERENCE)
TRITON_CHUNK_SIZES = (16, 32)
TRITON_CHUNK_SIZE, REFERENCE_CHUNK_SIZE = 32, 64  # the defaults (chunk_size=None); see the module docstring
MAX_TRITON_HEAD_DIM = 256  # a program holds whole [chunk, d_k] tiles and [d_k, 64] states in registers


def _resolve(backend: str | None, q: torch.Tensor, chunk_size: int | None) -> tuple[str, int]:
    """(backend, chunk size) for this call."""
    chosen = pick_backend(_OP, [q], _AVAILABLE, backend)
    if chosen == TRITON and q.dtype == torch.float64:
        if backend is None:
            return REFERENCE, chunk_size or REFERENCE_CHUNK_SIZE
        raise TypeError(f"{_OP}: the Triton backend takes fp16/bf16/fp32; use backend='reference' for float64")
    if chosen == TRITON and not q.is_cuda and not triton_interpreting():
        raise RuntimeError(f"{_OP}: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (or backend='reference')")
    if chosen == REFERENCE:
        return chosen, chunk_size or REFERENCE_CHUNK_SIZE
    if chunk_size is not None and chunk_size not in TRITON_CHUNK_SIZES:
        raise ValueError(f"{_OP}: chunk_size must be one of {TRITON_CHUNK_SIZES} (or None) on the Triton backend, "
                         f"got {chunk_size}")
    return chosen, chunk_size or TRITON_CHUNK_SIZE


def _packed(q, k, v, g, beta):
    """The inputs as contiguous [tokens, ...] tensors (batch rows laid end to end)."""
    return tuple(x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta))


def _num_docs(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _host_cu(cu_seqlens, batch: int, seq: int) -> torch.Tensor:
    if cu_seqlens is None:
        return torch.arange(0, batch + 1, dtype=torch.int64) * seq
    return check_cu_seqlens(_OP, cu_seqlens, seq)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::gated_delta_rule")  # a whole sequence scan: kept, not recomputed


@torch.library.custom_op("xorl::gated_delta_rule", mutates_args=())
def _gated_delta_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                    use_qk_l2norm: bool, chunk_size: int | None, backend: str | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq = q.shape[:2]
    qp, kp, vp, gp, bp = _packed(q, k, v, g, beta)
    init = initial_state.contiguous() if initial_state is not None else None
    chosen, chunk_size = _resolve(backend, q, chunk_size)
    if chosen == REFERENCE:
        out, final = gated_delta_forward_reference(qp, kp, vp, gp, bp, scale, init, _host_cu(cu_seqlens, batch, seq),
                                                   use_qk_l2norm, chunk_size)
    else:
        from xorl_kernels.gated_delta.fwd_triton import gated_delta_forward_triton

        chunks = doc_chunks(_OP, cu_seqlens, batch, seq, chunk_size, q.device)
        out, final = gated_delta_forward_triton(qp, kp, vp, gp, bp, scale, init, chunks, use_qk_l2norm, chunk_size)
    return out.view(v.shape), final


@_gated_delta_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, chunk_size, backend):
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    final = q.new_empty((_num_docs(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3]), dtype=state_dtype)
    return v.new_empty(v.shape, dtype=q.dtype), final


@torch.library.custom_op("xorl::gated_delta_rule_backward", mutates_args=())
def _gated_delta_backward_op(
    d_out: torch.Tensor, d_final: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    scale: float, use_qk_l2norm: bool, chunk_size: int | None, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, d_initial_state); the last is empty without an initial state (a custom
    op cannot return None)."""
    batch, seq = q.shape[:2]
    qp, kp, vp, gp, bp = _packed(q, k, v, g, beta)
    dop = d_out.reshape(vp.shape).contiguous()
    init = initial_state.contiguous() if initial_state is not None else None
    dfin = d_final.contiguous() if d_final is not None else None
    chosen, chunk_size = _resolve(backend, q, chunk_size)
    if chosen == REFERENCE:
        grads = gated_delta_backward_reference(dop, dfin, qp, kp, vp, gp, bp, scale, init,
                                               _host_cu(cu_seqlens, batch, seq), use_qk_l2norm, chunk_size)
    else:
        from xorl_kernels.gated_delta.bwd_triton import gated_delta_backward_triton

        chunks = doc_chunks(_OP, cu_seqlens, batch, seq, chunk_size, q.device)
        grads = gated_delta_backward_triton(dop, dfin, qp, kp, vp, gp, bp, scale, init, chunks, use_qk_l2norm,
                                            chunk_size)
    dq, dk, dv, dg, dbeta, d_init = grads
    d_init = d_init.to(initial_state.dtype) if initial_state is not None else q.new_empty(0)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g.shape), dbeta.view(beta.shape), d_init


@_gated_delta_backward_op.register_fake
def _(d_out, d_final, q, k, v, g, beta, initial_state, *args):
    d_init = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty(0)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), d_init)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, *options = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.options = options


def _backward(ctx, d_out, d_final):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, d_init = torch.ops.xorl.gated_delta_rule_backward(
        d_out, d_final, q, k, v, g, beta, initial_state, cu_seqlens, *ctx.options)
    return dq, dk, dv, dg, dbeta, d_init if initial_state is not None else None, None, None, None, None, None


_gated_delta_op.register_autograd(_backward, setup_context=_setup_context)


def _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"{_OP}: q and k must both be [batch, seq, heads_k, d_k], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{_OP}: v must be [batch, seq, heads_v, d_v] with q's batch and seq {tuple(q.shape[:2])}, "
                         f"got {tuple(v.shape)}")
    heads_k, heads_v = q.shape[2], v.shape[2]
    if heads_k == 0 or heads_v % heads_k:
        raise ValueError(f"{_OP}: heads_k ({heads_k}) must divide heads_v ({heads_v}): each key head serves "
                         "heads_v // heads_k consecutive value heads")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != tuple(v.shape[:3]):
            raise ValueError(f"{_OP}: {name} must be [batch, seq, heads_v] = {tuple(v.shape[:3])}, got {tuple(t.shape)}")
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if q.dtype not in floats or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{_OP}: q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    tensors = [t for t in (q, k, v, g, beta, initial_state) if t is not None]
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"{_OP}: q, k, v, g, beta and initial_state must be on one device")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"{_OP}: with cu_seqlens the batch dim must be 1 (packed documents), got {q.shape[0]}")
    if initial_state is not None:
        want = (_num_docs(q, cu_seqlens), heads_v, q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"{_OP}: initial_state must be [docs, heads_v, d_k, d_v] = {want}, got "
                             f"{tuple(initial_state.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{_OP}: chunk_size must be >= 1 (or None), got {chunk_size}")
    if q.is_cuda and max(q.shape[3], v.shape[3]) > MAX_TRITON_HEAD_DIM:
        raise ValueError(f"{_OP}: head dims above {MAX_TRITON_HEAD_DIM} are not supported by the Triton kernels, "
                         f"got d_k={q.shape[3]}, d_v={v.shape[3]}")


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False, chunk_size=None, *, backend=None):
    """(out, final_state or None), differentiable w.r.t. q, k, v, g, beta and initial_state (through
    out and final_state). See the module docstring."""
    chunk_size = None if chunk_size is None else int(chunk_size)
    _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    out, final = torch.ops.xorl.gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                                 bool(use_qk_l2norm_in_kernel), chunk_size, backend)
    return out, (final if output_final_state else None)
