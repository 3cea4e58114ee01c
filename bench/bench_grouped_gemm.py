"""Grouped GEMM (MoE experts): xorl_kernels.expert_gemm.op vs dense cuBLAS and torch._grouped_mm.

For each model's expert GEMMs (up: hidden -> ffn, down: ffn -> hidden) at 16K tokens, with
balanced routing and with Zipf-skewed top-k routing, forward (y = x @ w[g]) and backward
(dx = dy @ w[g]^T plus dw[g] = x_g^T @ dy_g) are timed in TFLOP/s. Anchors, same run and device:

- dense cuBLAS matmul at equal FLOPs: one [M, K] @ [K, N] (backward: its two gradient matmuls);
  the ceiling a grouped GEMM chases, since it does the same FLOPs with ragged, smaller tiles.
- torch._grouped_mm (CUTLASS, sm_90+, bf16): the grouped kernel PyTorch users run today;
  skipped with a note where it does not exist or refuses the layout.

Peak fraction is against ctx.peaks["matmul_tflops"]. On CPU (ctx.quick or no GPU) the shapes are
tiny and grouped_gemm runs its CPU dispatch (the plain-torch reference): a smoke test of the
harness, not a performance figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.context import BenchContext, Result
from xorl_kernels.expert_gemm.op import grouped_gemm


@dataclass(frozen=True)
class MoEShape:
    model: str
    num_experts: int
    hidden: int
    ffn: int  # per-expert intermediate width
    top_k: int


GPU_SHAPES = [
    MoEShape("Mixtral-8x7B", num_experts=8, hidden=4096, ffn=14336, top_k=2),
    MoEShape("Qwen3-30B-A3B", num_experts=128, hidden=2048, ffn=768, top_k=8),
    MoEShape("DeepSeek-V3", num_experts=256, hidden=7168, ffn=2048, top_k=8),
]
CPU_SHAPES = [
    MoEShape("tiny-coarse", num_experts=4, hidden=64, ffn=128, top_k=2),
    MoEShape("tiny-fine", num_experts=16, hidden=64, ffn=32, top_k=4),
]
GPU_TOKENS = 16384
CPU_TOKENS = 128
ZIPF_EXPONENT = 1.2


def route(num_tokens: int, shape: MoEShape, skewed: bool, device: torch.device) -> torch.Tensor:
    """Tokens per expert for top-k routing: exactly balanced, or Zipf-popular experts.

    Skewed: each token picks top_k distinct experts, as a router does, with expert popularity
    ~ rank**-1.2 (so no expert gets more rows than there are tokens, and cold experts get none).
    """
    rows = num_tokens * shape.top_k
    if not skewed:
        sizes = torch.full((shape.num_experts,), rows // shape.num_experts)
        sizes[: rows % shape.num_experts] += 1
        return sizes.to(device=device, dtype=torch.int32)
    gen = torch.Generator().manual_seed(1234)
    ranks = torch.randperm(shape.num_experts, generator=gen) + 1
    popularity = ranks.double().pow(-ZIPF_EXPONENT).float()
    choices = torch.multinomial(popularity.expand(num_tokens, -1), shape.top_k, generator=gen)
    sizes = torch.bincount(choices.flatten(), minlength=shape.num_experts)
    return sizes.to(device=device, dtype=torch.int32)


def _tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def _grouped_mm_calls(x, w, dy, group_sizes):
    """(forward, backward) closures over torch._grouped_mm, or a note saying why there are none."""
    if not hasattr(torch, "_grouped_mm"):
        return None, f"torch {torch.__version__} has no torch._grouped_mm"
    if not x.is_cuda:
        return None, "torch._grouped_mm timed on GPU only"
    if torch.cuda.get_device_capability(x.device) < (9, 0) or x.dtype != torch.bfloat16:
        return None, "torch._grouped_mm needs sm_90+ and bf16"
    offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)  # end row of each group
    refusals = []
    # Which weight layout torch._grouped_mm accepts (and is fast with) differs across versions:
    # try w as given, then a column-major copy (as torchtitan stores [G, out, in] weights).
    for layout in ("row-major w", "column-major w"):
        w_fwd = w if layout == "row-major w" else w.transpose(1, 2).contiguous().transpose(1, 2)
        w_bwd = w_fwd.transpose(1, 2)

        def forward(w_fwd=w_fwd):
            return torch._grouped_mm(x, w_fwd, offs=offs)

        def backward(w_bwd=w_bwd):
            dx = torch._grouped_mm(dy, w_bwd, offs=offs)
            dw = torch._grouped_mm(x.t(), dy, offs=offs)  # 2D x 2D, groups along the reduction dim
            return dx, dw

        try:
            forward()
            backward()
        except RuntimeError as err:  # layout / alignment / arch refusals differ across torch versions
            refusals.append(f"{layout}: {str(err).splitlines()[0][:120]}")
            continue
        return (forward, backward), f"torch._grouped_mm with {layout}"
    return None, "torch._grouped_mm refused these inputs: " + "; ".join(refusals)


def _bench_one(
    ctx: BenchContext, shape: MoEShape, gemm: str, skewed: bool, num_tokens: int, dtype: torch.dtype
) -> list[Result]:
    k, n = (shape.hidden, shape.ffn) if gemm == "up" else (shape.ffn, shape.hidden)
    group_sizes = route(num_tokens, shape, skewed, ctx.device)
    m = num_tokens * shape.top_k
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    x = torch.randn(m, k, device=ctx.device, dtype=dtype, generator=gen)
    w = torch.randn(shape.num_experts, k, n, device=ctx.device, dtype=dtype, generator=gen) / k**0.5
    dy = torch.randn(m, n, device=ctx.device, dtype=dtype, generator=gen)
    w_dense = w[0]

    def ours_backward():
        x_, w_ = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y_ = grouped_gemm(x_, w_, group_sizes)
        return torch.autograd.grad(y_, (x_, w_), dy)

    forward_flops = 2.0 * m * k * n
    candidates: dict[str, dict[str, Callable[[], object]]] = {
        "fwd": {
            "ours": lambda: grouped_gemm(x, w, group_sizes),
            "dense": lambda: x @ w_dense,
        },
        # Ours: forward + autograd backward, minus the forward time below (the same for all).
        "bwd": {
            "ours": ours_backward,
            "dense": lambda: (dy @ w_dense.T, x.T @ dy),
        },
    }
    grouped_mm, note = _grouped_mm_calls(x, w, dy, group_sizes)
    if grouped_mm is not None:
        candidates["fwd"]["grouped_mm"], candidates["bwd"]["grouped_mm"] = grouped_mm

    iters = 10 if ctx.on_gpu else 3
    seconds = {
        pass_name: {name: ctx.time(fn, iters=iters) for name, fn in fns.items()}
        for pass_name, fns in candidates.items()
    }
    fwd_and_bwd = seconds["bwd"]["ours"]
    # Timer noise can make the difference non-positive on tiny CPU shapes: then keep fwd + bwd.
    backward_only = fwd_and_bwd - seconds["fwd"]["ours"]
    seconds["bwd"]["ours"] = backward_only if backward_only > 0 else fwd_and_bwd

    rel_err = None
    if grouped_mm is not None:
        ref = grouped_mm[0]().float()
        rel_err = ((grouped_gemm(x, w, group_sizes).float() - ref).norm() / ref.norm()).item()

    sizes_host = group_sizes.tolist()
    routing = "zipf" if skewed else "balanced"
    params = {
        "model": shape.model,
        "gemm": gemm,
        "routing": routing,
        "tokens": num_tokens,
        "M": m,
        "K": k,
        "N": n,
        "groups": shape.num_experts,
        "top_k": shape.top_k,
        "dtype": str(dtype).removeprefix("torch."),
        "max_group_rows": max(sizes_host),
        "empty_groups": sum(s == 0 for s in sizes_host),
        "backend": "triton" if ctx.on_gpu else "reference (CPU)",
    }
    params["grouped_mm_note"] = note
    if rel_err is not None:
        params["rel_err_vs_grouped_mm"] = rel_err

    peak = ctx.peaks.get("matmul_tflops")
    dense_anchor = "dense cuBLAS matmul, equal FLOPs" if ctx.on_gpu else "dense torch matmul (CPU), equal FLOPs"
    results = []
    for pass_name, flops in (("fwd", forward_flops), ("bwd", 2 * forward_flops)):
        ours = _tflops(flops, seconds[pass_name]["ours"])
        label = f"grouped_gemm {pass_name} {shape.model} {gemm} {routing}"
        common = dict(value=ours, unit="TFLOP/s", peak_fraction=ours / peak if peak else None, params=params)
        dense = _tflops(flops, seconds[pass_name]["dense"])
        results.append(Result(name=label, anchor=dense_anchor, anchor_value=dense, **common))
        if "grouped_mm" in seconds[pass_name]:
            theirs = _tflops(flops, seconds[pass_name]["grouped_mm"])
            results.append(Result(name=label, anchor="torch._grouped_mm", anchor_value=theirs, **common))
    return results


def run(ctx: BenchContext) -> list[Result]:
    small = ctx.quick or not ctx.on_gpu
    shapes, num_tokens = (CPU_SHAPES, CPU_TOKENS) if small else (GPU_SHAPES, GPU_TOKENS)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = []
    for shape in shapes:
        for gemm in ("up", "down"):
            for skewed in (False, True):
                results += _bench_one(ctx, shape, gemm, skewed, num_tokens, dtype)
                if ctx.on_gpu:
                    torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    context = BenchContext(device=device, peaks={}, quick=not torch.cuda.is_available())
    for result in run(context):
        print(f"{result.name:55s} {result.value:9.2f} {result.unit}  x{result.ratio:5.2f} vs {result.anchor}")
