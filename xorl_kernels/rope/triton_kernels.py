"""Triton rotary embedding, forward and backward in one kernel (backward = the rotation by -angle:
``BACKWARD`` swaps the sign of sin, cos / sin halves being read separately so any tables work).

One program per (token, block of heads): cos / sin of the token are loaded once and applied to
every head of the block; the pass-through dims of partial rotary are copied by the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, head_dim, rot, stride_tok, stride_head,
                 cs_stride, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    half = rot // 2
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    cs = tok * cs_stride
    c1 = tl.load(cos_ptr + cs + j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + half + j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + j, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + half + j, mask=jm, other=0.0).to(tl.float32)
    hm = heads < n_heads
    base = tok * stride_tok + heads[:, None] * stride_head
    m2 = hm[:, None] & jm[None, :]
    x1 = tl.load(x_ptr + base + j[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half + j[None, :], mask=m2, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + j[None, :], o1.to(dt), mask=m2)
    tl.store(out_ptr + base + half + j[None, :], o2.to(dt), mask=m2)
    if BLOCK_D > 0:  # partial rotary: copy the dims past ``rot``
        d = rot + tl.arange(0, BLOCK_D)
        md = hm[:, None] & (d < head_dim)[None, :]
        tail = tl.load(x_ptr + base + d[None, :], mask=md, other=0.0)
        tl.store(out_ptr + base + d[None, :], tail.to(dt), mask=md)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x [b, s, h, d] contiguous, cos / sin [b, s, rot] contiguous -> a new tensor like x."""
    b, s, h, d = x.shape
    rot = cos.shape[-1]
    out = torch.empty_like(x)
    block_h = min(triton.next_power_of_2(h), 4 if triton_interpreting() else 16)
    tail = d - rot
    if b * s and h:
        _rope_kernel[(b * s, triton.cdiv(h, block_h))](
            x, cos, sin, out, h, d, rot, h * d, d, rot, BACKWARD=backward, BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(max(rot // 2, 1)), BLOCK_D=triton.next_power_of_2(tail) if tail else 0,
        )
    return out
