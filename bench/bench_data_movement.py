"""The csrc data-movement kernels: zig-zag shard gather, Ulysses pack/unpack, routing metadata.

Each copy kernel is reported in GB/s (bytes read + written) against a device-to-device copy of
the same number of bytes (the target is a ratio >= 0.85: these kernels should run at copy speed)
and against the plain-torch way (index_select / permute + cat). Routing metadata is reported in
microseconds against torch's stable argsort + bincount (lower is better). Where the extension is
not built (CPU) the op's own dispatch runs the torch path, so the rows still show the harness works.

GPU: hidden states [1, 65536, 4096] bf16 sharded for 8 ranks over 16 packed documents (gather
and the in-place scatter back); Ulysses pack / unpack in both directions for Q/K/V [1, 8192 per
rank, 32 | 8 | 8 heads, 128] bf16 on 8 ranks (Llama-3-8B-like) and [1, 8192 per rank, 32 | 4 | 4
heads, 128] on 4 ranks (examples/qwen3_30b_a3b_pp2_ep4_cp4.yaml: rows of 16 MB after the
all-to-all, the case one warp per row used to leave idle); 32K tokens, top-8 of 128 experts.
CPU (or ctx.quick): tiny shapes.
"""

from __future__ import annotations

import torch

from bench.context import BenchContext, Result
from xorl_kernels.dispatch import CSRC, REFERENCE, pick_backend
from xorl_kernels.moe_permute.routing import routing_metadata, routing_metadata_reference
from xorl_kernels.ulysses.op import ulysses_pack, ulysses_pack_reverse, ulysses_unpack, ulysses_unpack_reverse
from xorl_kernels.ulysses.reference import (
    ulysses_pack_reference,
    ulysses_pack_reverse_reference,
    ulysses_unpack_reference,
    ulysses_unpack_reverse_reference,
)
from xorl_kernels.zigzag.op import zigzag_gather, zigzag_scatter
from xorl_kernels.zigzag.reference import zigzag_gather_reference, zigzag_scatter_reference


def _copy_gbps(ctx: BenchContext, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / ctx.time(lambda: dst.copy_(src)) / 1e9


def _bandwidth_results(ctx, name, fn, reference, moved_bytes, params) -> list[Result]:
    """Two Results for one copy kernel: vs a plain copy of the same bytes, and vs the torch way."""
    backend = "csrc" if params.get("csrc") else "torch"
    gbps = 2.0 * moved_bytes / ctx.time(fn) / 1e9
    ref_gbps = 2.0 * moved_bytes / ctx.time(reference) / 1e9
    peak = ctx.peaks.get("copy_gbps")
    fraction = gbps / peak if peak else None
    return [
        Result(
            f"{name} [{backend}]",
            gbps,
            "GB/s",
            "device copy of the same bytes",
            _copy_gbps(ctx, moved_bytes),
            peak_fraction=fraction,
            params=params,
        ),
        Result(
            f"{name} [{backend}] vs torch",
            gbps,
            "GB/s",
            "plain torch (index_select / permute+cat)",
            ref_gbps,
            peak_fraction=fraction,
            params=params,
        ),
    ]


def bench_zigzag(ctx: BenchContext, dtype: torch.dtype) -> list[Result]:
    seq, hidden, world, docs = (65536, 4096, 8, 16) if ctx.on_gpu and not ctx.quick else (1024, 64, 4, 4)
    x = torch.randn(1, seq, hidden, device=ctx.device).to(dtype)
    cu = torch.arange(docs + 1, device=ctx.device, dtype=torch.int64) * (seq // docs)
    shard_bytes = seq // world * hidden * x.element_size()
    params = {
        "seq": seq,
        "hidden": hidden,
        "world": world,
        "docs": docs,
        "dtype": dtype,
        "csrc": pick_backend("zigzag_gather", [x], (CSRC, REFERENCE)) == CSRC,
    }
    shard = zigzag_gather_reference(x, 1, 3, world, cu)
    results = _bandwidth_results(
        ctx,
        f"zigzag_gather s{seq} h{hidden} P{world} {docs} docs",
        lambda: zigzag_gather(x, 1, 3, world, cu),
        lambda: zigzag_gather_reference(x, 1, 3, world, cu),
        shard_bytes,
        params,
    )
    return results + _bandwidth_results(
        ctx,
        f"zigzag_scatter (in place) s{seq} h{hidden} P{world} {docs} docs",
        lambda: zigzag_scatter(shard, 1, 3, world, cu, out=x),
        lambda: zigzag_scatter_reference(shard, 1, 3, world, cu, out=x),
        shard_bytes,
        params,
    )


def bench_ulysses(ctx: BenchContext, dtype: torch.dtype) -> list[Result]:
    if ctx.on_gpu and not ctx.quick:
        cases = [(8192, 32, 8, 128, 8), (8192, 32, 4, 128, 4)]
    else:
        cases = [(128, 8, 4, 16, 4)]
    return [r for case in cases for r in _bench_ulysses_case(ctx, dtype, *case)]


def _bench_ulysses_case(ctx, dtype, seq_local, heads, kv_heads, head_dim, world) -> list[Result]:
    shapes = [(1, seq_local, h, head_dim) for h in (heads, kv_heads, kv_heads)]
    qkv = [torch.randn(s, device=ctx.device).to(dtype) for s in shapes]
    moved = sum(t.numel() for t in qkv) * qkv[0].element_size()
    params = {
        "seq_local": seq_local,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "world": world,
        "dtype": dtype,
        "csrc": pick_backend("ulysses_pack", qkv, (CSRC, REFERENCE)) == CSRC,
    }
    results = _bandwidth_results(
        ctx,
        f"ulysses_pack qkv s{seq_local} h{heads}/{kv_heads} d{head_dim} P{world}",
        lambda: ulysses_pack(qkv, world),
        lambda: ulysses_pack_reference(qkv, world),
        moved,
        params,
    )
    recv = ulysses_pack_reference(qkv, world)
    results += _bandwidth_results(
        ctx,
        f"ulysses_unpack qkv s{seq_local} h{heads}/{kv_heads} d{head_dim} P{world}",
        lambda: ulysses_unpack(recv, world, shapes),
        lambda: ulysses_unpack_reference(recv, world, shapes),
        moved,
        params,
    )
    # The reverse direction, after attention: head-sharded [1, P*s, h/P, d] back to sequence shards.
    heads_out = ulysses_unpack_reference(recv, world, shapes)
    rshapes = [tuple(t.shape) for t in heads_out]
    results += _bandwidth_results(
        ctx,
        f"ulysses_pack_reverse qkv s{seq_local} h{heads}/{kv_heads} d{head_dim} P{world}",
        lambda: ulysses_pack_reverse(heads_out, world),
        lambda: ulysses_pack_reverse_reference(heads_out, world),
        moved,
        params,
    )
    rrecv = ulysses_pack_reverse_reference(heads_out, world)
    results += _bandwidth_results(
        ctx,
        f"ulysses_unpack_reverse qkv s{seq_local} h{heads}/{kv_heads} d{head_dim} P{world}",
        lambda: ulysses_unpack_reverse(rrecv, world, rshapes),
        lambda: ulysses_unpack_reverse_reference(rrecv, world, rshapes),
        moved,
        params,
    )
    return results


def bench_routing(ctx: BenchContext) -> list[Result]:
    tokens, top_k, experts = (32768, 8, 128) if ctx.on_gpu and not ctx.quick else (256, 2, 8)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    logits = torch.randn(tokens, experts, device=ctx.device, generator=gen)
    ids = logits.topk(top_k, dim=-1).indices
    us = ctx.time(lambda: routing_metadata(ids, experts)) * 1e6
    ref_us = ctx.time(lambda: routing_metadata_reference(ids, experts)) * 1e6
    backend = pick_backend("routing_metadata", [ids], (CSRC, REFERENCE))
    return [
        Result(
            f"routing_metadata T{tokens} K{top_k} E{experts} [{backend}]",
            us,
            "us",
            "torch reference (stable sort + scatter histogram)",
            ref_us,
            higher_is_better=False,
            params={"tokens": tokens, "top_k": top_k, "experts": experts, "csrc": backend == "csrc"},
        )
    ]


def run(ctx: BenchContext) -> list[Result]:
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    return bench_zigzag(ctx, dtype) + bench_ulysses(ctx, dtype) + bench_routing(ctx)
