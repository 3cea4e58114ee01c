"""Fused linear + cross-entropy: the summed token loss of ``hidden @ weight^T`` without the logits.

``fused_linear_cross_entropy(hidden, weight, labels, ...)`` -> fp32 scalar
    sum over tokens with ``labels != ignore_index`` of ``lse - logit[label] + z_loss * lse**2``
    (``lse`` = log-sum-exp of the token's logits; label smoothing: none).

- ``hidden`` [tokens, H], ``weight`` [V, H] (the lm_head; under vocabulary parallelism this rank's
  rows ``vocab_start .. vocab_start + V``), ``labels`` [tokens] int (global vocabulary ids).
- The tokens are taken ``chunk_size`` at a time: a chunk's logits [chunk, V] (the compute dtype)
  are the only vocabulary-wide buffer; ``[tokens, V]`` never exists, in fp32 or otherwise.
- Gradients are computed in the forward's chunk loop (Liger-Kernel's scheme): while the chunk's
  logits are at hand, their gradient is written over them and turned into that chunk's
  ``d_hidden`` rows and its share of ``d_weight`` (accumulated in the weight's dtype, as the
  weight's own gradient would be). Backward only scales them by the incoming gradient, so no
  logits are recomputed. Under ``torch.no_grad`` (or inputs that need no gradient) they are skipped.
  A second backward through one forward is refused, except a replay with the same gradient tensor
  (zero-bubble pipeline schedules run the input pass, then the weight pass from the captured gradient).
- Vocabulary parallel: ``reduce`` is an object with ``max_(t)`` and ``sum_(t)`` (in-place all-reduces
  over the ranks that share the vocabulary; xorl.nn.cross_entropy builds it from the TP group, so
  this package holds no process group). Per chunk: the row max is all-reduced (MAX), then the
  rescaled sum of exponentials and the target logit together (one SUM of a [2, chunk] buffer);
  every rank then has the global log-sum-exp and writes the gradient of its own columns. Each rank's
  ``d_hidden`` is its partial sum over its columns: the caller sums it over the ranks.

Per-chunk kernels (custom ops ``xorl::linear_ce_chunk_stats`` / ``xorl::linear_ce_chunk_grad_``):
Triton on CUDA tensors, the plain-torch reference on CPU (xorl_kernels.dispatch).
"""

from __future__ import annotations

import math

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend, triton_interpreting
from xorl_kernels.fused_linear_ce.reference import chunk_grad_reference, chunk_stats_reference

_AVAILABLE = (TRITON, REFERENCE)
MIN_CHUNK = 128


def default_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: the chunk's logits about as large as the hidden states themselves
    (tokens x H elements; Liger's rule), at least MIN_CHUNK tokens so the GEMMs stay efficient."""
    chunks = max(1, math.ceil(vocab / max(hidden, 1)))
    size = 1 << max(0, math.ceil(tokens / chunks) - 1).bit_length()
    return max(1, min(tokens, max(size, MIN_CHUNK)))


def _resolve_backend(backend: str | None, x: torch.Tensor) -> str:
    chosen = pick_backend("fused_linear_cross_entropy", [x], _AVAILABLE, backend)
    if chosen == TRITON and not x.is_cuda and not triton_interpreting():
        raise RuntimeError(
            "fused_linear_cross_entropy: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
            "triton is imported, or use backend='reference'"
        )
    return chosen


@torch.library.custom_op("xorl::linear_ce_chunk_stats", mutates_args=())
def _chunk_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                 backend: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _resolve_backend(backend, logits) == REFERENCE:
        return chunk_stats_reference(logits, labels, vocab_start)
    from xorl_kernels.fused_linear_ce.triton_kernels import chunk_stats_triton

    return chunk_stats_triton(logits, labels.contiguous(), vocab_start)


@_chunk_stats.register_fake
def _(logits, labels, vocab_start, backend):
    rows = logits.shape[0]
    return tuple(logits.new_empty(rows, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("xorl::linear_ce_chunk_grad_", mutates_args=("logits",))
def _chunk_grad_(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                 row_scale: torch.Tensor, z_loss: float, backend: str | None) -> None:
    if _resolve_backend(backend, logits) == REFERENCE:
        logits.copy_(chunk_grad_reference(logits, labels, vocab_start, lse, row_scale, z_loss))
        return
    from xorl_kernels.fused_linear_ce.triton_kernels import chunk_grad_triton_

    chunk_grad_triton_(logits, labels.contiguous(), vocab_start, lse.contiguous(), row_scale.contiguous(), z_loss)


@_chunk_grad_.register_fake
def _(logits, labels, vocab_start, lse, row_scale, z_loss, backend):
    return None


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, ignore_index, z_loss, reduce, chunk_size, backend):
        tokens = hidden.shape[0]
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty_like(hidden) if want_dh else None
        d_weight = torch.zeros_like(weight) if want_dw else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_size):
            h = hidden[start:start + chunk_size]
            y = labels[start:start + chunk_size]
            logits = h @ weight.T  # [chunk, V] in the compute dtype: the one vocabulary-wide buffer
            row_max, sum_exp, target = torch.ops.xorl.linear_ce_chunk_stats(logits, y, vocab_start, backend)
            if reduce is not None:
                global_max = row_max.clone()
                reduce.max_(global_max)
                both = torch.stack([sum_exp * (row_max - global_max).exp(), target])
                reduce.sum_(both)
                row_max, sum_exp, target = global_max, both[0], both[1]
            lse = row_max + sum_exp.log()
            valid = (y != ignore_index).to(torch.float32)
            loss += ((lse - target + z_loss * lse * lse) * valid).sum()
            if want_dh or want_dw:
                torch.ops.xorl.linear_ce_chunk_grad_(logits, y, vocab_start, lse, valid, z_loss, backend)
                if want_dh:
                    torch.mm(logits, weight, out=d_hidden[start:start + chunk_size])
                if want_dw:
                    # out= rather than addmm_: the same in-place update, and FLOP counters know addmm.
                    torch.addmm(d_weight, logits.T, h, out=d_weight)
            del logits
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.scaled_by = None  # the gradient the buffers were scaled by, once backward ran
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.scaled_by is not None and grad_loss is not ctx.scaled_by:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward ran twice through one forward (retain_graph); its "
                "gradients are scaled in place, so run the forward again instead"
            )
        d_hidden, d_weight = ctx.saved_tensors
        if ctx.scaled_by is not None:
            # Zero-bubble pipeline schedules run this node twice with the same gradient tensor: the
            # input pass, then the weight pass from the gradient it captured (torch.distributed.
            # pipelining's stage_backward_weight). The buffers already hold that product.
            return d_hidden, d_weight, None, None, None, None, None, None, None
        ctx.scaled_by = grad_loss
        # Scaled in place: a fresh [V, H] copy would add a parameter-sized buffer at the loss's peak.
        # Through .data, whose version counter is its own: the saved buffers stay unpackable for that
        # replay (they are this op's own, so no other saved tensor sees the change).
        scale = grad_loss.to(torch.float32)
        for grad in (d_hidden, d_weight):
            if grad is not None:
                grad.data.mul_(scale)
        return d_hidden, d_weight, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
    z_loss: float = 0.0, vocab_start: int = 0, reduce=None, chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Summed cross-entropy (+ z-loss) of ``hidden @ weight.T`` against ``labels``; see the module docstring."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden must be [tokens, H] and weight [V, H], got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: labels must be [tokens]={hidden.shape[0]}, got {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"fused_linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}")
    if backend is not None:
        _resolve_backend(backend, hidden)
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], weight.shape[1])
    if chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    return _FusedLinearCrossEntropy.apply(
        hidden.contiguous(), weight, labels.contiguous(), int(vocab_start), int(ignore_index), float(z_loss),
        reduce, int(chunk_size), backend,
    )
