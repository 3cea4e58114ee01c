"""Achieved efficiency of the device's kernels and links: curves read from efficiency.json.

The numbers are fractions of the device's peaks (--peak-tflops, --hbm-gbps, link rates), so a
curve fitted on one GPU scales to another of the same family. Each entry of efficiency.json says
where it comes from: a published figure, or an ASSUMPTION until scripts/plan_calibrate.py refits
it from a GPU run's bench/ results (it writes a new file with the same keys; pass it with
XORL_PLAN_EFFICIENCY=path or --efficiency path).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "efficiency.json")


def interpolate(table: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear in log2(x) between the table's points; clamped at both ends."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + w * (y1 - y0)
    return table[-1][1]


@dataclass(frozen=True)
class Efficiency:
    gemm_max: float
    gemm_by_min_dim: tuple[tuple[float, float], ...]
    grouped_by_tokens_per_expert: tuple[tuple[float, float], ...]
    attn_fwd: float
    attn_bwd: float
    hbm_fraction: float
    launch_s: float
    nvlink_fraction: float
    net_fraction: float
    latency_nvlink_s: float
    latency_net_s: float
    overlap_interference: float
    p2p_fraction: float  # NCCL send/recv between two GPUs (the TP ring), of --nvlink-gbps
    sms: int  # streaming multiprocessors: a GEMM runs in waves of this many tiles
    tile_m: int  # a large bf16 GEMM's output tile
    tile_n: int
    # FP8 GEMMs (train.fp8; xorl/planner/fp8_time.py): fractions of the FP8 peak by recipe, and their
    # curve by the smallest dimension (a refit file without an "fp8" entry keeps the shipped one's)
    fp8_max: tuple[tuple[str, float], ...] = ()
    fp8_by_min_dim: tuple[tuple[float, float], ...] = ()

    def gemm(self, m: float, n: float, k: float) -> float:
        """Fraction of peak a [m, k] x [k, n] GEMM reaches."""
        return self.gemm_max * interpolate(self.gemm_by_min_dim, max(1.0, min(m, n, k)))

    def grouped(self, tokens_per_expert: float, n: float, k: float) -> float:
        """Fraction of peak of a grouped GEMM: the dense curve of its weights' n, k, times the
        grouped curve of its tokens per expert (the ragged M dimension)."""
        return (self.gemm_max * interpolate(self.gemm_by_min_dim, max(1.0, min(n, k)))
                * interpolate(self.grouped_by_tokens_per_expert, max(1.0, tokens_per_expert)))

    def fp8_gemm(self, recipe: str, m: float, n: float, k: float) -> float:
        """Fraction of the FP8 peak a [m, k] x [k, n] GEMM of ``recipe`` reaches."""
        return dict(self.fp8_max)[recipe] * interpolate(self.fp8_by_min_dim, max(1.0, min(m, n, k)))

    def fp8_grouped(self, recipe: str, tokens_per_expert: float, n: float, k: float) -> float:
        """Fraction of the FP8 peak of an FP8 grouped GEMM: ``grouped`` with the FP8 curves."""
        return self.fp8_gemm(recipe, n, n, k) * interpolate(self.grouped_by_tokens_per_expert,
                                                            max(1.0, tokens_per_expert))

    @classmethod
    def from_dict(cls, d: dict) -> Efficiency:
        nccl = d["nccl"]
        if "fp8" not in d:  # an older refit file: the shipped FP8 entries
            with open(DEFAULT_PATH) as f:
                d = {**d, "fp8": json.load(f)["fp8"]}
        return cls(
            gemm_max=d["gemm"]["max_fraction"],
            gemm_by_min_dim=tuple(tuple(x) for x in d["gemm"]["by_min_dim"]),
            grouped_by_tokens_per_expert=tuple(tuple(x) for x in d["grouped_gemm"]["by_tokens_per_expert"]),
            attn_fwd=d["attention"]["fwd_fraction"], attn_bwd=d["attention"]["bwd_fraction"],
            hbm_fraction=d["hbm_fraction"], launch_s=d["launch_us"] * 1e-6,
            nvlink_fraction=nccl["nvlink_fraction"], net_fraction=nccl["net_fraction"],
            latency_nvlink_s=nccl["latency_nvlink_us"] * 1e-6, latency_net_s=nccl["latency_net_us"] * 1e-6,
            overlap_interference=nccl["overlap_interference"], p2p_fraction=nccl["p2p_fraction"],
            sms=d["gemm"]["waves"]["sms"], tile_m=d["gemm"]["waves"]["tile"][0], tile_n=d["gemm"]["waves"]["tile"][1],
            fp8_max=tuple(d["fp8"]["max_fraction"].items()),
            fp8_by_min_dim=tuple(tuple(x) for x in d["fp8"]["by_min_dim"]),
        )


@functools.lru_cache(maxsize=4)
def load(path: str | None = None) -> Efficiency:
    path = path or os.environ.get("XORL_PLAN_EFFICIENCY") or DEFAULT_PATH
    with open(path) as f:
        return Efficiency.from_dict(json.load(f))
