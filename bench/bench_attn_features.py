"""Flash attention's model-family shapes: MLA head dims and sliding windows, vs torch SDPA and flex.

1. MLA (DeepSeek-V3: q·k head dim 192, v 128; 16 heads = 128 / TP 8), causal, bf16, seq 4K and
   16K (16K tokens per batch): forward and forward+backward TFLOP/s of xorl_kernels.flash_attn
   against the fastest torch SDPA backend that takes d_v != d_qk, and against flex attention
   (torch.compile'd, causal block mask) on the same tensors.
2. Sliding window (gpt-oss: W = 128, head dim 64, GQA 16/2 per TP rank; Mistral-style W = 4096 at
   head dim 128), causal, bf16, seq 4K-32K: the same two anchors, SDPA with the window as a dense
   boolean mask (what transformers' sdpa path runs) and flex with a sliding-window block mask
   (flex skips blocks outside the window, as our kernels do).

FLOPs count the visible (query, key) pairs exactly: 2·pairs·(d_qk + d_v) per head forward, 3.5×
that forward+backward (the convention of bench_flash_attn.py); the ratio is ours / anchor at equal
FLOPs, i.e. the anchor's time over ours.

On CPU (ctx.quick or no GPU) sizes are tiny, flash_attn runs torch's CPU flash kernel and flex
runs eagerly: a smoke test of the harness, not a performance figure.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from bench.bench_flash_attn import _sdpa_backends
from bench.context import BenchContext, Result
from xorl_kernels.attention.op import flash_attn

# (label, seqs, heads_q, heads_kv, d_qk, d_v, window)
GPU_CASES = [
    ("MLA", [4096, 16384], 16, 16, 192, 128, None),
    ("window", [4096, 16384, 32768], 16, 2, 64, 64, 128),
    ("window", [8192, 32768], 16, 8, 128, 128, 4096),
]
CPU_CASES = [("MLA", [64], 2, 2, 24, 16, None), ("window", [64], 4, 2, 16, 16, 8)]
GPU_TOKENS = 16384


def visible_pairs(seq: int, window: int | None) -> int:
    """Causal (query, key) pairs, within the window when given: Σ_i min(i + 1, W)."""
    w = seq if window is None else min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def _ours(q, k, v, do, window, backward: bool) -> None:
    out = flash_attn(q, k, v, causal=True, window=window)
    if backward:
        out.backward(do)


def _sdpa(q, k, v, do, mask, backend, backward: bool) -> None:
    """q/k/v [B, H, S, D] (K/V repeated to the query heads, as transformers' repeat_kv does)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kwargs = dict(is_causal=True) if mask is None else dict(attn_mask=mask)
    if backend is None:
        out = sdpa(q, k, v, **kwargs)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            out = sdpa(q, k, v, **kwargs)
    if backward:
        out.backward(do)


def _time_sdpa(ctx: BenchContext, q, k, v, do, mask, backward: bool) -> tuple[float, str]:
    best, best_name = float("inf"), "none"
    for name, backend in _sdpa_backends() if ctx.on_gpu else [("math", None)]:
        try:
            seconds = ctx.time(partial(_sdpa, q, k, v, do, mask, backend, backward))
        except RuntimeError:  # this backend refuses the shape (d_v != d_qk, a mask) or runs out of memory
            continue
        if seconds < best:
            best, best_name = seconds, name
    return best, best_name


def _flex(ctx: BenchContext, seq: int, window: int | None):
    """(flex_attention callable, block mask) or None where this torch has no flex attention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        return keep if window is None else keep & (q_idx - kv_idx < window)

    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=ctx.device)
    fn = torch.compile(flex_attention, dynamic=False) if ctx.on_gpu else flex_attention
    return fn, block_mask


def _flex_step(flex, block_mask, q, k, v, do, backward: bool) -> None:
    out = flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
    if backward:
        out.backward(do)


def _bench_case(ctx, label, seq, tokens, hq, hk, d_qk, d_v, window, dtype) -> list[Result]:
    batch = max(1, tokens // seq)
    gen = torch.Generator(device=ctx.device).manual_seed(seq + d_qk)

    def rand(h, d):
        return torch.randn(batch, seq, h, d, device=ctx.device, dtype=dtype, generator=gen)

    q, k, v, do = rand(hq, d_qk), rand(hk, d_qk), rand(hk, d_v), rand(hq, d_v)
    ours_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    bhsd = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]
    do_bhsd = do.transpose(1, 2).contiguous()
    mask = None
    if window is not None:
        idx = torch.arange(seq, device=ctx.device)
        mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - window)
    flex = None
    try:
        flex = _flex(ctx, seq, window)
    except Exception as error:  # noqa: BLE001 - flex attention unavailable on this device / torch build
        print(f"no flex attention here ({type(error).__name__}: {str(error)[:120]})", file=sys.stderr)
    fwd_flops = 2 * batch * hq * visible_pairs(seq, window) * (d_qk + d_v)
    peak = ctx.peaks.get("matmul_tflops")
    params = dict(batch=batch, seq=seq, heads=hq, kv_heads=hk, head_dim_qk=d_qk, head_dim_v=d_v, window=window,
                  dtype=str(dtype), causal=True)
    shape = f"hd{d_qk}/{d_v}" if d_qk != d_v else f"hd{d_qk}"
    gqa = f" GQA {hq}/{hk}" if hk != hq else ""
    results = []
    for phase, flops, backward in (("fwd", fwd_flops, False), ("fwd+bwd", 3.5 * fwd_flops, True)):
        name = f"flash_attn {label}{'' if window is None else window} {phase} causal{gqa} {shape} s{seq}"
        with torch.set_grad_enabled(backward):
            ours_s = ctx.time(partial(_ours, *ours_in, do, window, backward))
            sdpa_s, sdpa_name = _time_sdpa(ctx, *bhsd, do_bhsd, mask, backward)
        tflops = flops / ours_s / 1e12
        anchors = [(f"torch SDPA best backend ({sdpa_name}{', dense window mask' if mask is not None else ''})",
                    sdpa_s)]
        if flex is not None:
            flex_in = bhsd if backward else [t.detach() for t in bhsd]  # CPU flex refuses grad-requiring inputs
            try:
                with torch.set_grad_enabled(backward):
                    anchors.append(("flex attention (block mask)",
                                    ctx.time(partial(_flex_step, *flex, *flex_in, do_bhsd, backward))))
            except Exception as error:  # noqa: BLE001 - e.g. no flex backward on CPU
                print(f"{name}: no flex anchor ({type(error).__name__}: {str(error)[:120]})", file=sys.stderr)
        for anchor, seconds in anchors:
            if seconds == float("inf"):
                continue
            results.append(Result(
                name=name if anchor.startswith("torch SDPA") else f"{name} vs flex", value=tflops, unit="TFLOP/s",
                anchor=anchor, anchor_value=flops / seconds / 1e12,
                peak_fraction=tflops / peak if peak else None, params=params,
            ))
    return results


def run(ctx: BenchContext) -> list[Result]:
    small = ctx.quick or not ctx.on_gpu
    cases, tokens = (CPU_CASES, 64) if small else (GPU_CASES, GPU_TOKENS)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = []
    for label, seqs, hq, hk, d_qk, d_v, window in cases:
        for seq in seqs:
            results += _bench_case(ctx, label, seq, max(tokens, seq), hq, hk, d_qk, d_v, window, dtype)
    return results


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    context = BenchContext(device=device, peaks={}, quick=not torch.cuda.is_available())
    for result in run(context):
        print(f"{result.name:64s} {result.value:10.3f} {result.unit:8s} x{result.ratio:5.2f} vs {result.anchor}")
