"""delta = rowsum(dO·O) for the flash-attention backward: one Triton pass, no fp32 temporaries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.attention import common
from xorl_kernels.attention.common import INTERPRET, block_head_dim, check_device, last_dim_contiguous, load_tile


@triton.jit
def _flash_attn_bwd_preprocess_kernel(
    O, DO, DELTA, total, seq, heads, stride_ot, stride_oh, stride_dot, stride_doh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """delta[b, h, s] = Σ_d O·dO in fp32 for token t = b·seq + s (one pass, no fp32 temporaries)."""
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    valid = offs_t < total
    o = load_tile(O + head * stride_oh, offs_t, stride_ot, offs_d, valid, HEAD_DIM, BLOCK_D, False)
    do = load_tile(DO + head * stride_doh, offs_t, stride_dot, offs_d, valid, HEAD_DIM, BLOCK_D, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    t64 = offs_t.to(tl.int64)
    row = (t64 // seq) * heads * seq + head * seq + t64 % seq
    tl.store(DELTA + row, delta, mask=valid)


def triton_bwd_preprocess(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """delta fp32 in lse layout: [batch, heads, seq] for 4-D out, [heads, total] for 3-D out."""
    check_device(out, do)
    out, do = last_dim_contiguous(out), last_dim_contiguous(do)
    batched = out.dim() == 4
    batch, seq = (out.shape[0], out.shape[1]) if batched else (1, out.shape[0])
    heads, head_dim = out.shape[-2], out.shape[-1]
    o2, do2 = (t.reshape(batch * seq, heads, head_dim) for t in (out, do))
    delta = common.alloc_output((batch, heads, seq), torch.float32, out.device)
    if batch * seq and heads:
        block_t = 16 if INTERPRET else 64
        grid = (triton.cdiv(batch * seq, block_t), heads)
        _flash_attn_bwd_preprocess_kernel[grid](
            o2, do2, delta, batch * seq, seq, heads, o2.stride(0), o2.stride(1), do2.stride(0), do2.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_head_dim(head_dim), BLOCK_T=block_t,
        )
    return delta if batched else delta[0]
