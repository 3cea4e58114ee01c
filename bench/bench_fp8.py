"""FP8 GEMMs (train.fp8, xorl_kernels/fp8) against the bf16 kernels they replace.

- dense: ``fp8_linear`` per recipe on an 8192 x 8192 x 8192 linear, anchored on the bf16 cuBLAS
  matmul of the same shape. Two rows per recipe: the GEMM alone (operands quantised beforehand:
  torch._scaled_mm for tensorwise / rowwise, xorl's Triton kernel for blockwise) and forward +
  backward of the whole op (quantisation of every operand included) against bf16 F.linear forward
  + backward. The issue's goal is >= 1.6x on the GEMM.
- grouped: ``fp8_grouped_gemm`` (blockwise, Triton) on the expert GEMMs of bench_grouped_gemm's
  models at 16K tokens (balanced routing), anchored on bf16 ``torch._grouped_mm``; GEMM alone and
  forward with quantisation. Goal >= 1.5x.
- casts: each recipe's quantisation of a Llama-3.1-8B-sized activation (16K tokens x 4096) and weight
  (gate / up, 14336 x 4096), plain and as the transposed view the backward GEMMs pass, through
  ``quantize_operand`` (the fused Triton kernels on GPU, xorl_kernels/fp8/triton_quantize.py). GB/s of
  the bytes a cast must move (read the operand once, write the fp8 copy) against a device-to-device copy
  of the same bytes: ~1.0 for the one-pass casts, ~0.6 where the operand is read twice (tensorwise's amax
  pass, rowwise's long rows). The eager plain-torch casts of the same operand in params.

GPU figures only: on CPU (no GPU, or --quick) tiny shapes run once as a smoke test of the code
path, anchored on fp32 torch matmul / xorl's grouped_gemm, and are not performance figures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.bench_data_movement import _copy_gbps
from bench.bench_grouped_gemm import CPU_SHAPES, GPU_SHAPES, GPU_TOKENS, route
from bench.context import BenchContext, Result
from xorl_kernels.expert_gemm.op import grouped_gemm
from xorl_kernels.fp8.grouped import blockwise_grouped_mm, fp8_grouped_gemm
from xorl_kernels.fp8.linear import OPERANDS, RECIPES, fp8_linear, quantize_operand, scaled_mm_nt
from xorl_kernels.fp8.quantize import BLOCK, E4M3, quantize_blocks, quantize_blocks_reference


def _tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def _dense(ctx: BenchContext, size: int, dtype: torch.dtype) -> list[Result]:
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    x = torch.randn(size, size, device=ctx.device, dtype=dtype, generator=gen)
    w = torch.randn(size, size, device=ctx.device, dtype=dtype, generator=gen) / size**0.5
    dy = torch.randn(size, size, device=ctx.device, dtype=dtype, generator=gen)
    iters = 20 if ctx.on_gpu else 2
    flops = 2.0 * size**3
    anchor_name = "bf16 cuBLAS matmul" if ctx.on_gpu else "fp32 torch matmul (CPU smoke)"
    gemm_anchor = _tflops(flops, ctx.time(lambda: x @ w.t(), iters=iters))

    def linear_fwd_bwd(fn):
        x_, w_ = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        return torch.autograd.grad(fn(x_, w_), (x_, w_), dy)

    train_anchor = _tflops(3 * flops, ctx.time(lambda: linear_fwd_bwd(F.linear), iters=iters))
    peak = ctx.peaks.get("matmul_tflops")
    results = []
    for recipe in RECIPES:
        qx, qw = quantize_operand(x, recipe, "x"), quantize_operand(w, recipe, "w")
        gemm = _tflops(flops, ctx.time(lambda qx=qx, qw=qw: scaled_mm_nt(*qx, *qw, dtype), iters=iters))
        train = _tflops(3 * flops, ctx.time(
            lambda recipe=recipe: linear_fwd_bwd(lambda a, b: fp8_linear(a, b, None, recipe)), iters=iters))
        params = {"M": size, "K": size, "N": size, "recipe": recipe, "dtype": str(dtype).removeprefix("torch.")}
        results.append(Result(name=f"fp8 linear {recipe} gemm {size}^3", value=gemm, unit="TFLOP/s",
                              anchor=anchor_name, anchor_value=gemm_anchor,
                              peak_fraction=gemm / peak if peak else None, params=params))
        results.append(Result(name=f"fp8 linear {recipe} fwd+bwd incl. quantisation {size}^3", value=train,
                              unit="TFLOP/s", anchor=f"{anchor_name}: F.linear fwd+bwd", anchor_value=train_anchor,
                              params=params))
    return results


def _grouped(ctx: BenchContext, shape, gemm_kind: str, num_tokens: int, dtype: torch.dtype) -> list[Result]:
    k, n = (shape.hidden, shape.ffn) if gemm_kind == "up" else (shape.ffn, shape.hidden)
    sizes = route(num_tokens, shape, False, ctx.device)
    m = num_tokens * shape.top_k
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    x = torch.randn(m, k, device=ctx.device, dtype=dtype, generator=gen)
    w = torch.randn(shape.num_experts, k, n, device=ctx.device, dtype=dtype, generator=gen) / k**0.5
    qx, sx = quantize_blocks(x, 1, BLOCK, E4M3)
    qw, sw = quantize_blocks(w, BLOCK, BLOCK, E4M3)
    backend = "triton" if ctx.on_gpu else "reference"
    iters = 10 if ctx.on_gpu else 2
    flops = 2.0 * m * k * n
    gemm = _tflops(flops, ctx.time(lambda: blockwise_grouped_mm(qx, sx, qw, sw, sizes, dtype, backend), iters=iters))
    fwd = _tflops(flops, ctx.time(lambda: fp8_grouped_gemm(x, w, sizes, backend=backend), iters=iters))
    if ctx.on_gpu and hasattr(torch, "_grouped_mm"):
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        anchor_name = "bf16 torch._grouped_mm"
        anchor = _tflops(flops, ctx.time(lambda: torch._grouped_mm(x, w, offs=offs), iters=iters))
    else:
        anchor_name = "xorl grouped_gemm (CPU smoke)"
        anchor = _tflops(flops, ctx.time(lambda: grouped_gemm(x, w, sizes), iters=iters))
    params = {"model": shape.model, "gemm": gemm_kind, "M": m, "K": k, "N": n, "groups": shape.num_experts,
              "routing": "balanced", "backend": backend, "dtype": str(dtype).removeprefix("torch.")}
    label = f"fp8 grouped_gemm blockwise {shape.model} {gemm_kind}"
    peak = ctx.peaks.get("matmul_tflops")
    return [
        Result(name=f"{label} gemm", value=gemm, unit="TFLOP/s", anchor=anchor_name, anchor_value=anchor,
               peak_fraction=gemm / peak if peak else None, params=params),
        Result(name=f"{label} fwd incl. quantisation", value=fwd, unit="TFLOP/s", anchor=anchor_name,
               anchor_value=anchor, params=params),
    ]


def _casts(ctx: BenchContext, tokens: int, hidden: int, ffn: int, dtype: torch.dtype) -> list[Result]:
    gen = torch.Generator(device=ctx.device).manual_seed(11)
    activation = torch.randn(tokens, hidden, device=ctx.device, dtype=dtype, generator=gen)
    weight = torch.randn(ffn, hidden, device=ctx.device, dtype=dtype, generator=gen) / hidden**0.5
    iters = 20 if ctx.on_gpu else 2
    a = activation.element_size()
    peak = ctx.peaks.get("copy_gbps")
    results = []
    for recipe in RECIPES:
        for label, role, operand in (("activation", "x", activation), ("activation^T", "x_t", activation.t()),
                                     ("weight", "w", weight), ("weight^T", "w_t", weight.t())):
            moved = (a + 1) * operand.numel()  # read once, write the fp8 copy
            block, fp8 = OPERANDS[recipe][role]
            fused = lambda o=operand, r=role, rc=recipe: quantize_operand(o, rc, r)  # noqa: E731
            plain = lambda o=operand, b=block, f=fp8: quantize_blocks_reference(o, *b, f)  # noqa: E731
            gbps = moved / ctx.time(fused, iters=iters) / 1e9
            eager = moved / ctx.time(plain, iters=iters) / 1e9
            rows, cols = operand.shape
            results.append(Result(
                name=f"fp8 cast {recipe} {label} {rows}x{cols}", value=gbps, unit="GB/s",
                anchor="device copy of the same bytes", anchor_value=_copy_gbps(ctx, moved // 2),
                peak_fraction=gbps / peak if peak else None,
                params={"recipe": recipe, "role": role, "rows": rows, "cols": cols, "block": str(block),
                        "fp8": str(fp8).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
                        "eager_reference_gbps": eager, "speedup_vs_eager": gbps / eager}))
    return results


def run(ctx: BenchContext) -> list[Result]:
    small = ctx.quick or not ctx.on_gpu
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = _casts(ctx, *((256, 192, 320) if small else (16384, 4096, 14336)), dtype)
    results += _dense(ctx, 256 if small else 8192, dtype)
    shapes, tokens = (CPU_SHAPES[:1], 128) if small else (GPU_SHAPES, GPU_TOKENS)
    for shape in shapes:
        for gemm_kind in ("up", "down"):
            results += _grouped(ctx, shape, gemm_kind, tokens, dtype)
    return results
