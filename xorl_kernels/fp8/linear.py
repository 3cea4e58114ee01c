"""FP8 linear layer GEMMs through ``torch._scaled_mm``: ``fp8_linear(x, weight, bias, recipe)``.

``y = x @ weight^T + bias`` where each of the three GEMMs of a linear (forward, input gradient,
weight gradient) quantises its two operands to FP8 on the fly and multiplies them with their
scales. The master weight, its gradient and the output stay in the input dtype (fp32 master
weights on CPU, the bf16 compute copy under FSDP2 mixed precision on GPU): FP8 is a compute choice.

Recipes (``OPERANDS``: the block shape and dtype of each operand, every operand laid out
[rows, contraction]):

  tensorwise  one scale per tensor. e4m3 for x and w; e5m2 for the output gradient (its range
              under one scale is the widest; the classic hybrid recipe, Micikevicius et al. 2022).
  rowwise     one scale per row along the contraction dim (torchao's "rowwise"): e4m3 everywhere,
              the per-row scales carry the range.
  blockwise   DeepSeek-V3: activations and gradients in 1 x 128 tiles, weights in 128 x 128 blocks
              (symmetric, so w and w^T share one block grid), e4m3 everywhere.

GEMMs: tensorwise and rowwise are single ``torch._scaled_mm`` calls (CPU and CUDA). torch's
``_scaled_mm`` takes 1 x 128 / 128 x 128 scales only on some CUDA builds and never on CPU, so
blockwise runs xorl's Triton kernel (``triton_blockwise.py``, the expert grouped GEMM with one
group) on CUDA, and elsewhere ``torch._scaled_mm`` once per 128-wide slice of the contraction with
that slice's scales as row / column scales, summed in float32: the same formula.

Backward re-quantises the saved high-precision x and w rather than saving FP8 copies: the saved
tensors are what a bf16 linear saves (under FSDP2 the weight is re-gathered anyway), so FP8 adds
no activation memory. ``fp8_linear`` is the op ``xorl::fp8_linear`` (and ``xorl::fp8_linear_backward``):
torch custom ops, so a compiled block (train.compile) holds each as one node and selective checkpointing
keeps its output (the section "the dispatcher ops" below). The non-autograd pieces (``linear_forward``,
``linear_dgrad``, ``linear_wgrad``) are public so the tensor-parallel matmuls (``xorl.nn.tp_matmul``) run
the same GEMMs inside their own ops.

The casts (``quantize_operand``) are fused Triton kernels on CUDA tensors (``triton_quantize.py``: a
transposed operand read in place, one pass per block), the plain-torch reference on CPU, bit for bit
the same q and scales. What comes from torchao and what does not: the scale arithmetic is torchao's
(quantize.py).
torchao's ``Float8Linear`` is not used: ``convert_to_float8_training`` swaps the model's
nn.Linear modules after they are built (xorl builds each module once, with its recipe), its
layer multiplies whole (DTensor) weights where xorl's TP layers run their own overlapped chunked
GEMMs on local shards (``tp_comm``), and it has no 1 x 128 / 128 x 128 blockwise training recipe.
For the same reason ``train.fp8_all_gather`` is xorl's own (xorl/nn/fp8_all_gather.py, which
says why torchao's weight wrapper is not used as is): FSDP2 then gathers each tensorwise weight as
its float8 cast, torchao's ``Float8TrainingTensor``, whose bytes and scale the ops take as the GEMMs'
weight (``register_float8_weight_kernels``, ``weight_operand``); otherwise FSDP2 gathers the weights in ``train.dtype`` and each GEMM quantises its
gathered weight.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from xorl_kernels.fp8.quantize import BLOCK, E4M3, E5M2, expand_block_scale, quantize_blocks
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

RECIPES = ("tensorwise", "rowwise", "blockwise")

_TENSOR, _ROW, _TILE, _BLOCK = (None, None), (1, None), (1, BLOCK), (BLOCK, BLOCK)
# recipe -> operand -> (block shape [rows, cols] along [rows, contraction], fp8 dtype).
# x [M, K], w [N, K] (forward); dy [M, N], w_t = w^T [K, N] (input grad); dy_t [N, M], x_t [K, M] (weight grad).
OPERANDS = {
    "tensorwise": {"x": (_TENSOR, E4M3), "w": (_TENSOR, E4M3), "dy": (_TENSOR, E5M2),
                   "w_t": (_TENSOR, E4M3), "dy_t": (_TENSOR, E5M2), "x_t": (_TENSOR, E4M3)},
    "rowwise": {"x": (_ROW, E4M3), "w": (_ROW, E4M3), "dy": (_ROW, E4M3),
                "w_t": (_ROW, E4M3), "dy_t": (_ROW, E4M3), "x_t": (_ROW, E4M3)},
    "blockwise": {"x": (_TILE, E4M3), "w": (_BLOCK, E4M3), "dy": (_TILE, E4M3),
                  "w_t": (_BLOCK, E4M3), "dy_t": (_TILE, E4M3), "x_t": (_TILE, E4M3)},
}


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: use one of {RECIPES} (or 'none' for no FP8)")


def quantize_operand(t: torch.Tensor, recipe: str, role: str):
    """The operand ``role`` (OPERANDS) of ``recipe`` quantised: (q, scale, block shape)."""
    block, dtype = OPERANDS[recipe][role]
    q, scale = quantize_blocks(t, *block, dtype)
    return q, scale, block


def gathered_float8_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is one FSDP2 all-gathered in float8 (``train.fp8_all_gather``,
    xorl/nn/fp8_all_gather.py): torchao's ``Float8TrainingTensor`` (e4m3 data, one scale).
    Only FP8 runs call this, and they have torchao (the config rule for train.fp8)."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return isinstance(weight, Float8TrainingTensor)


def weight_operand(weight: torch.Tensor, recipe: str, role: str, weight_qscale: torch.Tensor | None = None):
    """The weight [N, K] quantised as operand "w" (or its transpose, "w_t") of ``recipe``.

    ``weight_qscale`` given: ``weight`` arrives already cast, the e4m3 bytes of the tensorwise cast of
    the whole weight with the whole weight's amax (train.fp8_all_gather: the fields of torchao's
    ``Float8TrainingTensor``, whose ``_scale`` is this quantisation factor), used as it is: the
    tensorwise cast of w^T is the transpose of w's (the same amax, the same elementwise cast), so
    the bits equal ``quantize_operand`` of the gathered high-precision weight.
    """
    if weight_qscale is None:
        return quantize_operand(weight if role == "w" else weight.t(), recipe, role)
    if OPERANDS[recipe][role] != (_TENSOR, E4M3) or weight.dtype != E4M3:
        raise ValueError(f"a float8 all-gathered weight ({weight.dtype}) serves the tensorwise recipe's e4m3 weight "
                         f"only, not {recipe!r}")
    data = weight if role == "w" else weight.t()
    # torchao keeps the quantisation factor (a power of 2 here); the GEMM takes its exact reciprocal.
    return data.contiguous(), weight_qscale.float().reciprocal().reshape(1, 1), _TENSOR


def _pad16(q: torch.Tensor) -> torch.Tensor:
    """Zero-pad both dims of an fp8 matrix to multiples of 16, which torch._scaled_mm requires on
    CUDA (token counts of a shard need not be): zeros add nothing to the products. Through uint8,
    as F.pad has no fp8 kernels; the byte 0 is +0.0 in both fp8 formats."""
    rows, cols = q.shape
    pad_rows, pad_cols = -rows % 16, -cols % 16
    if not (pad_rows or pad_cols):
        return q
    return F.pad(q.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(q.dtype)


@functools.cache
def _cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row / column scales. torch 2.11 (the GPU image's)
    refuses them ("only supports per-tensor scaling for CPU backend"); 2.13's takes them. Asked once,
    with a 16 x 16 product: a feature check, not a version number."""
    a = torch.zeros(16, 16, dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _scaled_mm(qa, qb_t, sa, sb, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with 0-d scales or row scales sa [M, 1] and column scales sb [1, N]. Where
    the CPU kernel takes per-tensor scales only, the unit-scaled float32 product times the scales: the
    same formula, the scales applied after the float32 accumulation instead of inside it. CUDA
    always calls torch._scaled_mm itself (rowwise scales need sm_89+ there, which FP8 needs anyway)."""
    if sa.ndim and not qa.is_cuda and not _cpu_scaled_mm_takes_row_scales():
        one = torch.ones((), device=qa.device)
        out = torch._scaled_mm(qa, qb_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (out * sa * sb).to(out_dtype)
    return torch._scaled_mm(qa, qb_t, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def scaled_mm_nt(qa, sa, a_block, qb, sb, b_block, out_dtype: torch.dtype, backend: str | None = None):
    """``(qa * sa) @ (qb * sb)^T`` for qa [M, K], qb [N, K] and their block scales.

    ``backend`` (blockwise only): None picks Triton on CUDA and the sliced ``torch._scaled_mm``
    elsewhere; "triton" forces the kernel (CPU needs TRITON_INTERPRET=1), "scaled_mm" the slices.
    """
    if a_block in (_TENSOR, _ROW) and b_block == a_block:
        m, n = qa.shape[0], qb.shape[0]
        qa, qb = _pad16(qa), _pad16(qb)
        if a_block == _TENSOR:
            sa, sb = sa.reshape(()), sb.reshape(())
        else:  # padded rows get scale 1 (their values are 0)
            sa = F.pad(sa, (0, 0, 0, qa.shape[0] - m), value=1.0)
            sb = F.pad(sb, (0, 0, 0, qb.shape[0] - n), value=1.0).reshape(1, -1)
        out = _scaled_mm(qa, qb.t(), sa, sb, out_dtype)
        return out[:m, :n]
    if a_block != _TILE or b_block not in (_TILE, _BLOCK):
        raise ValueError(f"scaled_mm_nt: unsupported scale blocks {a_block} x {b_block}")
    if backend is None:
        backend = "triton" if qa.is_cuda else "scaled_mm"
    if backend == "triton":
        from xorl_kernels.fp8.triton_blockwise import fp8_blockwise_grouped_forward

        # One group: b = qb^T as [1, K, N]; its scales [1, K/128, N/128] (blocks) or [1, K/128, N] (tiles).
        sizes = torch.full((1,), qa.shape[0], dtype=torch.int32, device=qa.device)
        return fp8_blockwise_grouped_forward(qa, sa, qb.t().unsqueeze(0), sb.t().unsqueeze(0), sizes, out_dtype,
                                             sb_block_n=b_block[0])
    if backend != "scaled_mm":
        raise ValueError(f"scaled_mm_nt: backend={backend!r}: use None, 'triton' or 'scaled_mm'")
    n, k = qb.shape
    sb_rows = expand_block_scale(sb, b_block[0], n, 0)  # [N, K/128]: per-row scales of each K slice
    out = None
    for kb, start in enumerate(range(0, k, BLOCK)):
        stop = min(start + BLOCK, k)
        part = _scaled_mm(
            qa[:, start:stop].contiguous(), qb[:, start:stop].contiguous().t(),
            sa[:, kb:kb + 1].contiguous(), sb_rows[:, kb].reshape(1, n).contiguous(), torch.float32,
        )
        out = part if out is None else out.add_(part)
    return out.to(out_dtype)


def linear_forward(x2d: torch.Tensor, weight: torch.Tensor, recipe: str,
                   weight_qscale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in FP8 -> [M, N] in x's dtype (``weight_qscale``: ``weight_operand``)."""
    w = weight_operand(weight, recipe, "w", weight_qscale)
    return scaled_mm_nt(*quantize_operand(x2d, recipe, "x"), *w, x2d.dtype)


def linear_dgrad(dy2d: torch.Tensor, weight: torch.Tensor, recipe: str,
                 weight_qscale: torch.Tensor | None = None) -> torch.Tensor:
    """dy [M, N] @ weight [N, K] in FP8 -> dx [M, K] in dy's dtype (``weight_qscale``: ``weight_operand``)."""
    w_t = weight_operand(weight, recipe, "w_t", weight_qscale)
    return scaled_mm_nt(*quantize_operand(dy2d, recipe, "dy"), *w_t, dy2d.dtype)


def linear_wgrad(dy2d: torch.Tensor, x2d: torch.Tensor, recipe: str) -> torch.Tensor:
    """dy [M, N]^T @ x [M, K] in FP8 -> dw [N, K] in float32 (the caller casts to the weight's dtype)."""
    return scaled_mm_nt(*quantize_operand(dy2d.t(), recipe, "dy_t"), *quantize_operand(x2d.t(), recipe, "x_t"),
                        torch.float32)


# -- the dispatcher ops: forward and backward, each one node in a compiled block's graph ------------
# Why ops and not an autograd Function: torch.compile (train.compile, fullgraph) cannot trace into a
# Triton launch on fake tensors; an op with a fake kernel is one node, its real kernel the eager code
# above. And selective activation checkpointing (xorl/parallel/data_parallel.py) decides op by op: as
# one op the FP8 linear's output is kept whole and counted as the one dense matmul it is
# (selective_checkpoint: every_other_matmul), exactly as a bf16 linear's mm / addmm, so the
# planner's selective terms (a matmul output priced by its shape, not its recipe) hold for FP8. As
# an autograd Function its casts, its _scaled_mm calls (blockwise on CPU: one per 128 columns of K,
# each kept) or its Triton kernel (on CUDA: recomputed) were what the policy saw.
#
# ``weight_qscale``: None, or ``weight`` is already the tensorwise e4m3 cast and this its
# quantisation factor (``weight_operand``); only the Float8TrainingTensor rule below passes it.

SELECTIVE_CHECKPOINT_SAVES.join("xorl::fp8_linear", matmuls=lambda *_: 1)


def _out_dtype(x: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    return x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)


@torch.library.custom_op("xorl::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
                   weight_qscale: torch.Tensor | None = None) -> torch.Tensor:
    y = linear_forward(x.reshape(-1, x.shape[-1]), weight, recipe, weight_qscale)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@_fp8_linear_op.register_fake
def _(x, weight, bias, recipe, weight_qscale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=_out_dtype(x, bias))


@torch.library.custom_op("xorl::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str, need_dx: bool,
                            need_dw: bool, weight_qscale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in dy's dtype, dw in float32: the FP8 GEMM's accumulator, which the autograd formula casts
    to the weight's dtype: a float8-gathered weight's bytes, all this op sees, do not carry it); an
    empty tensor for one not needed."""
    dy2d = dy.reshape(-1, dy.shape[-1])
    dx = dw = dy.new_empty(0)
    if need_dx:
        dx = linear_dgrad(dy2d, weight, recipe, weight_qscale).reshape(x.shape).contiguous()
    if need_dw:
        dw = linear_wgrad(dy2d, x.reshape(-1, x.shape[-1]), recipe).contiguous()
    return dx, dw


@_fp8_linear_backward_op.register_fake
def _(dy, x, weight, recipe, need_dx, need_dw, weight_qscale=None):
    return dy.new_empty(x.shape if need_dx else 0), dy.new_empty(weight.shape if need_dw else 0, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, recipe, weight_qscale = inputs
    ctx.save_for_backward(x, weight, weight_qscale)
    ctx.recipe, ctx.has_bias = recipe, bias is not None


def _backward(ctx, dy):
    x, weight, weight_qscale = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = torch.ops.xorl.fp8_linear_backward(dy, x, weight, ctx.recipe, need_dx, need_dw, weight_qscale)
    db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx if need_dx else None, dw.to(weight.dtype) if need_dw else None, db, None, None


_fp8_linear_op.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.xorl.fp8_linear, get_raw=True)
def _fp8_linear_flops(x, weight, *args, out_val=None, **kwargs) -> int:
    return 2 * (x.numel() // x.shape[-1]) * weight.shape[0] * weight.shape[1]


@register_flop_formula(torch.ops.xorl.fp8_linear_backward, get_raw=True)
def _fp8_linear_backward_flops(dy, x, weight, recipe, need_dx, need_dw, *args, out_val=None, **kwargs) -> int:
    return 2 * (x.numel() // x.shape[-1]) * weight.shape[0] * weight.shape[1] * (int(need_dx) + int(need_dw))


@functools.cache
def register_float8_weight_kernels() -> None:
    """Let the ops take torchao's ``Float8TrainingTensor`` as their weight (train.fp8_all_gather:
    xorl/nn/fp8_all_gather.py calls this when it gives the weights their float8 all-gather).

    The tensor's __torch_dispatch__ knows torchao's ops only; for these two, this rule calls the same
    op on its fields, the float8 bytes and the quantisation factor (``weight_qscale``). It runs below
    autograd (the op's autograd formula saw the Float8TrainingTensor, so its gradient goes to that
    parameter, FSDP2's all-gathered one), and under torch.compile the tracer meets it the same way,
    so the compiled graph holds the op on the fields: one node, as for a plain weight. Called there,
    not on first sight of such a weight, so a run without one never imports torchao and a traced
    block registers nothing."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    def fields(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return weight._data, weight._scale

    @torch.library.register_torch_dispatch("xorl::fp8_linear", Float8TrainingTensor)
    def _(cls, func, types, args, kwargs):
        x, weight, bias, recipe, *_ = args
        data, qscale = fields(weight)
        return func(x, data, bias, recipe, qscale)

    @torch.library.register_torch_dispatch("xorl::fp8_linear_backward", Float8TrainingTensor)
    def _(cls, func, types, args, kwargs):
        dy, x, weight, recipe, need_dx, need_dw, *_ = args
        data, qscale = fields(weight)
        return func(dy, x, data, recipe, need_dx, need_dw, qscale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: str = "rowwise") -> torch.Tensor:
    """``x @ weight^T + bias`` with FP8 GEMMs (forward and both backward GEMMs); x [..., K], weight [N, K].

    ``recipe``: "tensorwise", "rowwise" or "blockwise" (module docstring). Differentiable in x,
    weight and bias; gradients come back in their dtypes. The op ``xorl::fp8_linear``.
    """
    check_recipe(recipe)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight {tuple(weight.shape)} expects {weight.shape[1]}")
    return torch.ops.xorl.fp8_linear(x, weight, bias, recipe)
