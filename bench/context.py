"""What every benchmark gets from the runner, and what it returns.

A benchmark is a module ``bench/bench_<topic>.py`` with ``run(ctx: BenchContext) -> list[Result]``.
Every figure is a ratio against an anchor measured in the same run on the same device (torch
SDPA, a dense matmul at equal FLOPs, a device-to-device copy of the same bytes, ...), and where it
makes sense also a fraction of the device's measured peak (``ctx.peaks``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Result:
    name: str  # e.g. "flash_attn fwd causal hd128 s8192"
    value: float  # the measured figure, in ``unit``
    unit: str  # "TFLOP/s", "GB/s", "ms", "x" ...
    anchor: str  # what it was compared with, e.g. "torch SDPA (flash backend)"
    anchor_value: float  # the anchor's figure in the same unit, same run, same device
    higher_is_better: bool = True
    peak_fraction: float | None = None  # value / the device's measured peak, where meaningful
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """value / anchor_value: >1 means faster than the anchor when higher is better."""
        return self.value / self.anchor_value if self.anchor_value else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class BenchContext:
    device: torch.device
    peaks: dict[str, float]  # "matmul_tflops" (bf16 on GPU, fp32 on CPU), "copy_gbps" (read+write)
    quick: bool = False  # small sizes: CPU runs and smoke tests

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def time(self, fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
        """Seconds per call of ``fn``: CUDA events on GPU, perf_counter on CPU; median of iters."""
        for _ in range(warmup):
            fn()
        samples = []
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            for _ in range(iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        samples.sort()
        return samples[len(samples) // 2]
