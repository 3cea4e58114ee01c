"""The device's measured peaks, the denominators of every Result's peak_fraction.

- ``matmul_tflops``: a large square matmul (bf16 8192^3 on GPU, fp32 and small on CPU), the
  ceiling for compute-bound kernels.
- ``copy_gbps``: a large device-to-device copy, counting bytes read + written, the ceiling for
  memory-bound kernels (permute, zig-zag, Ulysses pack).

Measured, not taken from a spec sheet, so clocks, power caps and MIG slices are accounted for.
"""

from __future__ import annotations

import torch

from bench.context import BenchContext


def _sizes(device: torch.device, quick: bool) -> tuple[int, torch.dtype, int]:
    """(matmul edge, matmul dtype, copy bytes)."""
    if device.type == "cuda":
        return (4096 if quick else 8192), torch.bfloat16, (256 if quick else 2048) << 20
    return (256 if quick else 1024), torch.float32, (16 if quick else 256) << 20


def measure_matmul_tflops(ctx: BenchContext, n: int, dtype: torch.dtype) -> float:
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(n, n, device=ctx.device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=ctx.device, generator=gen).to(dtype)
    out = torch.empty(n, n, device=ctx.device, dtype=dtype)
    seconds = ctx.time(lambda: torch.matmul(a, b, out=out), warmup=3, iters=10 if ctx.on_gpu else 5)
    return 2.0 * n**3 / seconds / 1e12


def measure_copy_gbps(ctx: BenchContext, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 256)
    dst = torch.empty_like(src)
    seconds = ctx.time(lambda: dst.copy_(src), warmup=3, iters=20 if ctx.on_gpu else 5)
    return 2.0 * nbytes / seconds / 1e9


def measure_peaks(device: torch.device, quick: bool) -> dict[str, float]:
    ctx = BenchContext(device=device, peaks={}, quick=quick)
    n, dtype, copy_bytes = _sizes(device, quick)
    return {
        "matmul_tflops": measure_matmul_tflops(ctx, n, dtype),
        "copy_gbps": measure_copy_gbps(ctx, copy_bytes),
        "matmul_size": float(n),
        "copy_bytes": float(copy_bytes),
    }
