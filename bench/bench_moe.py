"""The whole MoE layer (permute, gate/up, SwiGLU, down, unpermute), forward + backward, and the
permute / unpermute data movement on its own.

Layer: given the router's choice (expert ids and weights, the same for every candidate), time
forward + backward of ``expert_parallel_moe`` (one rank: permute_tokens -> grouped_gemm x3 ->
unpermute_tokens) in TFLOP/s (18 * T * K * hidden * moe_intermediate FLOPs). Anchors, same run:

- the per-expert loop of transformers' Qwen3MoeExperts (gather the tokens of each hit expert,
  three matmuls, index_add back), what HF users run today;
- torch._grouped_mm glue (argsort permute, three torch._grouped_mm, weighted index_add), guarded:
  needs torch._grouped_mm, sm_90+ and bf16.

Permute / unpermute: GB/s of each pass (bytes read + written) against a device-to-device copy of
the same number of bytes (target ratio >= 0.85), for every backend available (csrc, Triton).

GPU: 32K tokens, hidden 4096, 128 experts, top-8, moe_intermediate 1536 (Qwen3-235B-A22B-like),
bf16, target >= 500 TFLOP/s. CPU (or ctx.quick): tiny shapes, fp32; a harness smoke test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.context import BenchContext, Result
from xorl.nn.ep_dispatch import expert_parallel_moe
from xorl.nn.moe_experts import GroupedExperts
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens


@dataclass(frozen=True)
class LayerShape:
    tokens: int
    hidden: int
    num_experts: int
    top_k: int
    inter: int


GPU_SHAPE = LayerShape(tokens=32768, hidden=4096, num_experts=128, top_k=8, inter=1536)
CPU_SHAPE = LayerShape(tokens=256, hidden=64, num_experts=8, top_k=2, inter=32)


def _routing(shape: LayerShape, device, gen):
    """Router-like choice: top-k of random logits (distinct experts per token, near-balanced)."""
    logits = torch.randn(shape.tokens, shape.num_experts, device=device, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(shape.top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def per_expert_loop(x, ids, weights, gate_proj, up_proj, down_proj):
    """transformers' Qwen3MoeExperts.forward, written for the [E, in, out] layout."""
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(ids, num_classes=gate_proj.shape[0]).permute(2, 1, 0)  # [E, K, T]
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
    for expert in hit:
        e = expert[0]
        k_pos, token = torch.where(mask[e])
        xe = x[token]
        h = F.silu(xe @ gate_proj[e]) * (xe @ up_proj[e])
        ye = (h @ down_proj[e]) * weights[token, k_pos, None]
        out.index_add_(0, token, ye.to(out.dtype))
    return out


def grouped_mm_glue(x, ids, weights, gate_up_proj, down_proj):
    """What a user writes around torch._grouped_mm: argsort permute, 2 grouped GEMMs (gate and up
    fused, as ours), index_add."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // ids.shape[1]
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[token]
    gate, up = torch._grouped_mm(xs, gate_up_proj, offs=offs).chunk(2, dim=-1)
    h = F.silu(gate) * up
    ys = torch._grouped_mm(h, down_proj, offs=offs)
    ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys)


def _grouped_mm_note(x) -> str:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if not x.is_cuda:
        return "torch._grouped_mm timed on GPU only"
    if torch.cuda.get_device_capability(x.device) < (9, 0) or x.dtype != torch.bfloat16:
        return "torch._grouped_mm needs sm_90+ and bf16"
    return ""


def _fwd_bwd(fn, x, grad, params):
    def step():
        x_ = x.detach().requires_grad_(True)
        out = fn(x_)
        torch.autograd.grad(out, (x_, *params), grad)

    return step


def _bench_layer(ctx: BenchContext, shape: LayerShape, dtype) -> list[Result]:
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=dtype, generator=gen)
    grad = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=dtype, generator=gen)
    ids, weights = _routing(shape, dev, gen)
    experts = GroupedExperts(shape.num_experts, shape.hidden, shape.inter, device=dev, dtype=dtype)
    experts.init_weights(shape.hidden**-0.5)
    params = (experts.gate_up_proj, experts.down_proj)

    def split(gate_up, down):  # the loop takes gate and up apart
        return (*gate_up.chunk(2, dim=2), down)

    candidates = {
        "ours": lambda x_: expert_parallel_moe(x_, ids, weights, experts, shape.num_experts, None),
        "loop": lambda x_: per_expert_loop(x_, ids, weights, *split(*params)),
    }
    note = _grouped_mm_note(x)
    if not note:
        glue = lambda x_: grouped_mm_glue(x_, ids, weights, *params)
        try:
            _fwd_bwd(glue, x, grad, params)()
            candidates["grouped_mm"] = glue
        except RuntimeError as err:  # no autograd / layout refusal on some torch versions
            note = f"torch._grouped_mm glue failed: {str(err).splitlines()[0][:160]}"

    with torch.no_grad():
        ref = per_expert_loop(x.float(), ids, weights, *split(*(p.float() for p in params)))
        ours_out = candidates["ours"](x).float()
        rel_err = ((ours_out - ref).norm() / ref.norm()).item()

    iters = 10 if ctx.on_gpu else 3
    seconds = {name: ctx.time(_fwd_bwd(fn, x, grad, params), iters=iters) for name, fn in candidates.items()}
    flops = 18.0 * shape.tokens * shape.top_k * shape.hidden * shape.inter
    tflops = {name: flops / s / 1e12 for name, s in seconds.items()}
    info = {
        **shape.__dict__,
        "dtype": str(dtype).removeprefix("torch."),
        "rel_err_vs_fp32_loop": rel_err,
        "permute_backend": "auto",
    }
    if note:
        info["grouped_mm_note"] = note
    peak = ctx.peaks.get("matmul_tflops")
    common = dict(
        value=tflops["ours"], unit="TFLOP/s", peak_fraction=tflops["ours"] / peak if peak else None, params=info
    )
    name = "moe layer fwd+bwd"
    results = [
        Result(
            name=name, anchor="per-expert loop (transformers Qwen3MoeExperts)", anchor_value=tflops["loop"], **common
        )
    ]
    if "grouped_mm" in tflops:
        results.append(Result(name=name, anchor="torch._grouped_mm glue", anchor_value=tflops["grouped_mm"], **common))
    return results


def _permute_backends(ctx: BenchContext) -> list[str]:
    if not ctx.on_gpu:
        return ["reference"]
    from xorl_kernels import has_cuda_ext

    return (["csrc"] if has_cuda_ext() else []) + ["triton"]


def _bench_permute(ctx: BenchContext, shape: LayerShape, dtype) -> list[Result]:
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=dtype, generator=gen)
    ids, weights = _routing(shape, dev, gen)
    rows = shape.tokens * shape.top_k
    y_sorted = torch.randn(rows, shape.hidden, device=dev, dtype=dtype, generator=gen)
    elem = x.element_size()
    # Bytes each pass must move at least (read + write of the activations).
    permute_bytes = 2 * rows * shape.hidden * elem
    unpermute_bytes = (rows + shape.tokens) * shape.hidden * elem

    def copy_gbps(nbytes: int) -> float:
        src = torch.empty(nbytes // 2 // elem, dtype=dtype, device=dev)  # read + write = nbytes
        dst = torch.empty_like(src)
        return nbytes / ctx.time(lambda: dst.copy_(src)) / 1e9

    anchors = {"permute": copy_gbps(permute_bytes), "unpermute": copy_gbps(unpermute_bytes)}
    _, row_map, _ = permute_tokens(x, ids, shape.num_experts)
    results = []
    for backend in _permute_backends(ctx):
        passes = {
            "permute": (lambda b=backend: permute_tokens(x, ids, shape.num_experts, backend=b), permute_bytes),
            "unpermute": (lambda b=backend: unpermute_tokens(y_sorted, row_map, weights, backend=b), unpermute_bytes),
        }
        for pass_name, (fn, nbytes) in passes.items():
            gbps = nbytes / ctx.time(fn) / 1e9
            peak = ctx.peaks.get("copy_gbps")
            results.append(
                Result(
                    name=f"moe {pass_name} ({backend})",
                    value=gbps,
                    unit="GB/s",
                    anchor="device copy of the same bytes",
                    anchor_value=anchors[pass_name],
                    peak_fraction=gbps / peak if peak else None,
                    params={
                        **shape.__dict__,
                        "bytes": nbytes,
                        "dtype": str(dtype).removeprefix("torch."),
                        "includes": "routing metadata" if pass_name == "permute" else "combine only",
                    },
                )
            )
    return results


def run(ctx: BenchContext) -> list[Result]:
    small = ctx.quick or not ctx.on_gpu
    shape = CPU_SHAPE if small else GPU_SHAPE
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = _bench_permute(ctx, shape, dtype)
    results += _bench_layer(ctx, shape, dtype)
    return results


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    context = BenchContext(device=device, peaks={}, quick=not torch.cuda.is_available())
    for result in run(context):
        print(f"{result.name:40s} {result.value:9.2f} {result.unit}  x{result.ratio:6.2f} vs {result.anchor}")
