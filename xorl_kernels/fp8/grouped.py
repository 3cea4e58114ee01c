"""Blockwise FP8 grouped GEMM for MoE experts: ``fp8_grouped_gemm(x, w, group_sizes)``.

The same contract as ``xorl_kernels.grouped_gemm`` (x [M, K] rows sorted by group, w [G, K, N],
group_sizes [G] on x's device -> y [M, N] in x's dtype), computed with DeepSeek-V3's recipe:
x quantised to e4m3 in 1 x 128 tiles along K, each expert's weight in 128 x 128 blocks.

- forward ``y = x @ w[g]`` and input gradient ``dx = dy @ w[g]^T`` are FP8 GEMMs (dy in 1 x 128
  tiles along N; w^T reuses w's 128 x 128 block grid, transposed): Triton kernel
  (``triton_blockwise.py``) on CUDA, the plain-torch formula (exact dequantisation in float32,
  then ``grouped_gemm_reference``) on CPU;
- the weight gradient ``dw[g] = x_g^T @ dy_g`` is an FP8 GEMM too (DeepSeek-V3: both operands
  quantised along the contraction, here the tokens, in 1 x 128 tiles): its contraction runs over
  each expert's tokens, whose count is not a multiple of 128, so the token tiles start at each
  expert's first row and the last tile of an expert may be partial (``quantize.group_token_tiles``;
  DeepSeek-V3 pads every expert to whole tiles instead, the same grid). x and dy are re-quantised
  for it along the tokens (the forward's x tiles run along K; each GEMM quantises its operands
  along its own contraction). Triton kernel on CUDA, the plain-torch formula on CPU.

Weights are re-quantised from the saved high-precision tensor in backward (no FP8 copy held
between forward and backward).
"""

from __future__ import annotations

import torch

from xorl_kernels.dispatch import REFERENCE, TRITON, pick_backend
from xorl_kernels.expert_gemm.op import _check_inputs
from xorl_kernels.expert_gemm.reference import grouped_gemm_reference, grouped_gemm_weight_grad_reference
from xorl_kernels.fp8.quantize import (
    BLOCK,
    E4M3,
    expand_block_scale,
    group_token_tiles,
    quantize_blocks,
    quantize_token_tiles,
)
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

_AVAILABLE = (TRITON, REFERENCE)


def _dequantize_fp32(q: torch.Tensor, scale: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """q * scale in float32: exact (fp8 values times powers of 2), so the CPU path is the formula."""
    rows, cols = q.shape[-2:]
    full = expand_block_scale(expand_block_scale(scale, br, rows, -2), bc, cols, -1)
    return q.float() * full


def blockwise_grouped_mm(qa, sa, qb, sb, group_sizes, out_dtype, backend: str, sb_block_n: int = BLOCK):
    """``(qa * sa)[rows of g] @ (qb[g] * sb[g])`` (see triton_blockwise.py for the operand layouts)."""
    if backend == TRITON:
        from xorl_kernels.fp8.triton_blockwise import fp8_blockwise_grouped_forward

        return fp8_blockwise_grouped_forward(qa, sa, qb, sb, group_sizes, out_dtype, sb_block_n)
    a = _dequantize_fp32(qa, sa, 1, BLOCK)
    b = _dequantize_fp32(qb, sb, BLOCK, sb_block_n)
    return grouped_gemm_reference(a, b, group_sizes).to(out_dtype)


def blockwise_grouped_wgrad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, out_dtype: torch.dtype,
                            backend: str) -> torch.Tensor:
    """``dw[g] = x[rows of g]^T @ dy[rows of g]`` -> [G, K, N] in FP8: x and dy quantised in 1 x 128
    token tiles that start at each group's first row (``group_token_tiles``), products in float32."""
    tile_of_row, row_start, first_tile, num_tiles = group_token_tiles(group_sizes, x.shape[0])
    qx, sx = quantize_token_tiles(x, group_sizes, tile_of_row, num_tiles, E4M3)
    qdy, sdy = quantize_token_tiles(dy, group_sizes, tile_of_row, num_tiles, E4M3)
    if backend == TRITON:
        from xorl_kernels.fp8.triton_blockwise import fp8_blockwise_grouped_wgrad

        return fp8_blockwise_grouped_wgrad(qx, sx, qdy, sdy, group_sizes, row_start, first_tile, out_dtype)
    # q * scale in float32 is exact (fp8 values times powers of 2): the CPU path is the formula.
    a = qx.float() * sx.index_select(0, tile_of_row)
    b = qdy.float() * sdy.index_select(0, tile_of_row)
    return grouped_gemm_weight_grad_reference(a, b, group_sizes, out_dtype)


# -- the dispatcher ops (as the bf16 xorl::grouped_gemm: torch.compile traces an MoE block through
# them as one node each, and selective activation checkpointing keeps the output, not recomputing it)

SELECTIVE_CHECKPOINT_SAVES.join("xorl::fp8_grouped_gemm")


def _backend(backend: str | None, x: torch.Tensor) -> str:
    return pick_backend("fp8_grouped_gemm", [x], _AVAILABLE, backend)


@torch.library.custom_op("xorl::fp8_grouped_gemm", mutates_args=())
def _fp8_grouped_gemm_op(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor,
                         backend: str | None) -> torch.Tensor:
    qx, sx = quantize_blocks(x, 1, BLOCK, E4M3)
    qw, sw = quantize_blocks(w, BLOCK, BLOCK, E4M3)
    return blockwise_grouped_mm(qx, sx, qw, sw, group_sizes, x.dtype, _backend(backend, x))


@_fp8_grouped_gemm_op.register_fake
def _(x, w, group_sizes, backend):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("xorl::fp8_grouped_gemm_backward", mutates_args=())
def _fp8_grouped_gemm_backward_op(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor,
                                  backend: str | None, need_dx: bool, need_dw: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in dy's dtype, dw in w's dtype); an empty tensor for one not needed."""
    backend = _backend(backend, x)
    dx, dw = dy.new_empty(0), w.new_empty(0)
    if need_dx:
        qdy, sdy = quantize_blocks(dy, 1, BLOCK, E4M3)
        qw, sw = quantize_blocks(w, BLOCK, BLOCK, E4M3)
        dx = blockwise_grouped_mm(qdy, sdy, qw.transpose(1, 2), sw.transpose(1, 2), group_sizes, dy.dtype, backend)
    if need_dw:
        dw = blockwise_grouped_wgrad(x, dy, group_sizes, w.dtype, backend)
    return dx, dw


@_fp8_grouped_gemm_backward_op.register_fake
def _(dy, x, w, group_sizes, backend, need_dx, need_dw):
    return dy.new_empty(x.shape if need_dx else 0), w.new_empty(w.shape if need_dw else 0)


def _setup_context(ctx, inputs, output):
    x, w, group_sizes, backend = inputs
    ctx.save_for_backward(x, w, group_sizes)
    ctx.backend = backend


def _backward(ctx, dy):
    x, w, group_sizes = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = torch.ops.xorl.fp8_grouped_gemm_backward(dy, x, w, group_sizes, ctx.backend, need_dx, need_dw)
    return dx if need_dx else None, dw if need_dw else None, None, None


_fp8_grouped_gemm_op.register_autograd(_backward, setup_context=_setup_context)


def fp8_grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                     backend: str | None = None) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g]`` in blockwise FP8 (module docstring); differentiable.

    ``backend``: None (CUDA -> Triton, CPU -> plain torch; picked where the op runs), "triton" (CPU
    needs TRITON_INTERPRET=1) or "reference". The op ``xorl::fp8_grouped_gemm``.
    """
    _check_inputs(x, w, group_sizes)
    if backend is not None:
        _backend(backend, x)  # a wrong name is an error here, before any tracing
    return torch.ops.xorl.fp8_grouped_gemm(x, w, group_sizes, backend)
