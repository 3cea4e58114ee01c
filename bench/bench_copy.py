"""A device-to-device copy into a preallocated tensor against ``clone`` of the same bytes.

A trivial benchmark: it checks the harness end to end (``python -m bench --quick --only copy`` is
the runner's smoke test) and shows the allocator's cost on top of a plain copy. GB/s count bytes
read + written.
"""

from __future__ import annotations

import torch

from bench.context import BenchContext, Result


def run(ctx: BenchContext) -> list[Result]:
    nbytes = (4 << 20) if ctx.quick or not ctx.on_gpu else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 256)
    dst = torch.empty_like(src)
    copy_s = ctx.time(lambda: dst.copy_(src))
    clone_s = ctx.time(lambda: src.clone())
    gbps = lambda seconds: 2.0 * nbytes / seconds / 1e9
    return [
        Result(
            name=f"copy_ into preallocated, {nbytes >> 20} MiB",
            value=gbps(copy_s),
            unit="GB/s",
            anchor="torch.clone of the same bytes",
            anchor_value=gbps(clone_s),
            peak_fraction=gbps(copy_s) / ctx.peaks["copy_gbps"] if ctx.peaks.get("copy_gbps") else None,
            params={"bytes": nbytes},
        )
    ]
