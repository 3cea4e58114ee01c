"""Triton kernels of the fused linear cross-entropy: one pass for the row statistics, one for the
logit gradient (written in place over the chunk's logits, so a chunk holds one [rows, vocab] buffer).

Both read the logits in their dtype (bf16 on GPU) and compute in fp32. The statistics kernel walks
a row's columns once with an online max / rescaled sum of exponentials (Milakov & Gimelshein), so
the row is read once; the vocabulary-parallel all-reduces happen between the two kernels, on the
[rows] buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting


def _block(width: int) -> int:
    if triton_interpreting():
        return 32  # small tiles under the interpreter: CPU tests must still cross tile edges
    return min(4096, triton.next_power_of_2(width))


@triton.jit
def _stats_kernel(logits_ptr, stride_row, labels_ptr, max_ptr, sum_ptr, target_ptr, width, vocab_start,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int64) - vocab_start
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    target = tl.zeros((), tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
        target += tl.sum(tl.where(cols == label, x, 0.0), axis=0)
    tl.store(max_ptr + row, run_max)
    tl.store(sum_ptr + row, run_sum)
    tl.store(target_ptr + row, target)


@triton.jit
def _grad_kernel(logits_ptr, stride_row, labels_ptr, lse_ptr, scale_ptr, width, vocab_start, z_loss,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    base = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int64) - vocab_start
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
    grad = tl.exp(x - lse) * (scale * (1.0 + 2.0 * z_loss * lse))
    grad = tl.where(cols == label, grad - scale, grad)
    tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def chunk_stats_triton(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int):
    rows, width = logits.shape
    out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)]
    if rows:
        _stats_kernel[(rows,)](logits, logits.stride(0), labels, *out, width, vocab_start, BLOCK=_block(width))
    return tuple(out)


def chunk_grad_triton_(logits: torch.Tensor, labels, vocab_start: int, lse, row_scale, z_loss: float):
    """The logit gradient, written over ``logits`` (returned)."""
    rows, width = logits.shape
    block = _block(width)
    if rows:
        _grad_kernel[(rows, triton.cdiv(width, block))](
            logits, logits.stride(0), labels, lse, row_scale, width, vocab_start, float(z_loss), BLOCK=block
        )
    return logits
