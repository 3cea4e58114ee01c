"""Flash attention: xorl_kernels.attention.op vs torch SDPA, and the cost of the zig-zag ring split.

1. Causal attention, bf16, head_dim 128, 16 heads, 16K tokens per batch (seq 4K-32K): forward
   and forward+backward TFLOP/s against the fastest torch SDPA backend (flash / efficient /
   cuDNN, whichever runs fastest on this device), plus the fraction of ctx.peaks["matmul_tflops"].
   Where the flash-attn package imports, a second anchor: flash_attn_func on the same tensors.
   FLOPs count the causal half: fwd 2·(2·B·H·S²·D)/2, fwd+bwd 3.5× that (the usual convention).
   Plus one GQA row, 32 query / 4 KV heads at 4K tokens (Llama-3-70B's ratio per TP rank, where a
   dK/dV grid over KV heads alone would not fill the GPU): the SDPA anchor repeats K/V to 32 heads
   inside the timed step (what transformers' repeat_kv does), the package takes GQA natively.
2. Ring decomposition overhead: the P² zig-zag steps of all P ranks (every rank's q shard against
   every rank's k/v shard, one launch per step with true positions, as RingAttention issues them)
   run back-to-back on one device, against one monolithic causal attention over the whole
   sequence, P = 2, 4, 8; forward and backward separately (target ≤ 1.05×). The backward steps
   use the global lse/delta and accumulate into fp32 buffers, exactly as the ring backward does.
3. Exact (device independent) tile count of the same decomposition at the GPU size: attention
   tiles the kernel visits (128×64 blocks, fully masked blocks skipped) summed over all steps,
   over the monolithic count. Computed from positions only, so it is reported on CPU too.

On CPU (ctx.quick or no GPU) sizes are tiny and flash_attn runs torch's CPU flash kernel: a smoke
test of the harness, not a performance figure; the tile counts are exact everywhere.
"""

from __future__ import annotations

from functools import partial

import torch

from bench.context import BenchContext, Result
from xorl_kernels.attention.op import (
    flash_attn,
    flash_attn_backward,
    flash_attn_bwd_preprocess,
    flash_attn_forward,
)

GPU_SEQS = [4096, 8192, 16384, 32768]
GPU_TOKENS = 16384
GPU_RING_SEQ = 32768
CPU_SEQS = [128]
CPU_TOKENS = 128
CPU_RING_SEQ = 128
RING_SIZES = [2, 4, 8]
CPU_RING_SIZES = [2]
TILE_M, TILE_N = 128, 64


def _sdpa_backends():
    """[(name, SDPBackend or None)] for the SDPA backends this torch offers."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # very old torch: default dispatch only
        return [("default", None)]
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


def _sdpa_step(q, k, v, do, backend, backward: bool) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if k.shape[1] != q.shape[1]:  # GQA, [B, H, S, D]: repeat K/V heads as transformers does
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if backend is None:
        out = sdpa(q, k, v, is_causal=True)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            out = sdpa(q, k, v, is_causal=True)
    if backward:
        out.backward(do)


def _attn_step(attn, q, k, v, do, backward: bool) -> None:
    out = attn(q, k, v, causal=True)
    if backward:
        out.backward(do)


def _time_sdpa_best(ctx: BenchContext, q, k, v, do, backward: bool) -> tuple[float, str]:
    """Fastest SDPA time over its backends; q/k/v [B, H, S, D] (its native layout)."""
    best, best_name = float("inf"), "none"
    for name, backend in _sdpa_backends() if ctx.on_gpu else [("math", None)]:
        try:
            seconds = ctx.time(partial(_sdpa_step, q, k, v, do, backend, backward))
        except RuntimeError:  # backend refuses this shape/dtype/device
            continue
        if seconds < best:
            best, best_name = seconds, name
    return best, best_name


def _flash_attn_package():
    try:
        from flash_attn import flash_attn_func  # the pip package, not xorl_kernels.attention.op
    except Exception:  # noqa: BLE001 - absent or built for another torch
        return None
    return flash_attn_func


def _bench_seq(
    ctx: BenchContext, seq: int, tokens: int, heads: int, head_dim: int, dtype, kv_heads: int | None = None,
    phases: tuple[str, ...] = ("fwd", "fwd+bwd"),
) -> list[Result]:
    batch = max(1, tokens // seq)
    kv_heads = kv_heads or heads
    gen = torch.Generator(device=ctx.device).manual_seed(seq)
    q, k, v, do = (
        torch.randn(batch, seq, h, head_dim, device=ctx.device, dtype=dtype, generator=gen)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    sdpa_in = [t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]
    sdpa_do = do.transpose(1, 2).contiguous()
    fwd_flops = 2 * 2 * batch * heads * seq * seq * head_dim / 2
    peak = ctx.peaks.get("matmul_tflops")
    params = dict(batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype),
                  causal=True)
    package = _flash_attn_package() if ctx.on_gpu else None
    gqa = f" GQA {heads}/{kv_heads}" if kv_heads != heads else ""
    results = []
    for phase, flops, backward in (("fwd", fwd_flops, False), ("fwd+bwd", 3.5 * fwd_flops, True)):
        if phase not in phases:
            continue
        with torch.set_grad_enabled(backward):
            ours_s = ctx.time(partial(_attn_step, flash_attn, q, k, v, do, backward))
            sdpa_s, sdpa_name = _time_sdpa_best(ctx, *sdpa_in, sdpa_do, backward)
        tflops = flops / ours_s / 1e12
        name = f"flash_attn {phase} causal{gqa} hd{head_dim} s{seq}"
        results.append(Result(
            name=name, value=tflops, unit="TFLOP/s", anchor=f"torch SDPA best backend ({sdpa_name})",
            anchor_value=flops / sdpa_s / 1e12, peak_fraction=tflops / peak if peak else None, params=params,
        ))
        if package is not None:
            with torch.set_grad_enabled(backward):
                pkg_s = ctx.time(partial(_attn_step, package, q, k, v, do, backward))
            results.append(Result(
                name=name + " vs flash-attn package", value=tflops, unit="TFLOP/s",
                anchor="flash-attn package flash_attn_func", anchor_value=flops / pkg_s / 1e12,
                peak_fraction=tflops / peak if peak else None, params=params,
            ))
    return results


def zigzag_shards(seq: int, world: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token index, position) of every rank's zig-zag shard of one document of length seq."""
    chunk = seq // (2 * world)
    shards = []
    for rank in range(world):
        index = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * world - 1 - rank)])
        shards.append((index.to(device), index.to(device=device, dtype=torch.int32)))
    return shards


def visited_tiles(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """Tiles the causal kernel computes: a (q block, k block) pair is skipped iff min k_pos > max q_pos."""
    q_max = torch.stack([b.max() for b in q_pos.split(TILE_M)])
    k_min = torch.stack([b.min() for b in k_pos.split(TILE_N)])
    return int((k_min[None, :] <= q_max[:, None]).sum())


def _ring_forward_steps(qs, kvs, mask) -> None:
    for q_r, _, _, _, _, q_pos in qs:
        for k_s, v_s, k_pos in kvs:
            flash_attn_forward(q_r, k_s, v_s, q_positions=q_pos, k_positions=k_pos, **mask)


def _ring_backward_steps(qs, kvs, mask, grads) -> None:
    """Every step's backward with the global lse/delta, accumulating into fp32 buffers."""
    dq, dk, dv = grads
    for q_r, do_r, out_r, lse_r, delta_r, q_pos in qs:
        for k_s, v_s, k_pos in kvs:
            flash_attn_backward(do_r, q_r, k_s, v_s, out_r, lse_r, delta_r, q_positions=q_pos,
                                k_positions=k_pos, dq_accum=dq, dk_accum=dk, dv_accum=dv, **mask)


def _bench_ring(ctx: BenchContext, seq: int, ring_sizes, heads: int, head_dim: int, dtype) -> list[Result]:
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    q, k, v, do = (
        torch.randn(seq, heads, head_dim, device=ctx.device, dtype=dtype, generator=gen) for _ in range(4)
    )
    cu_full = torch.tensor([0, seq], dtype=torch.int32, device=ctx.device)

    def mono_fwd():
        return flash_attn_forward(q, k, v, causal=True, cu_seqlens=cu_full, max_seqlen=seq)

    out_full, lse_full = mono_fwd()
    delta_full = flash_attn_bwd_preprocess(out_full, do)

    def mono_bwd():
        flash_attn_backward(do, q, k, v, out_full, lse_full, delta_full, causal=True, cu_seqlens=cu_full,
                            max_seqlen=seq)

    mono_fwd_s, mono_bwd_s = ctx.time(mono_fwd), ctx.time(mono_bwd)
    results = []
    for world in ring_sizes:
        shards = zigzag_shards(seq, world, ctx.device)
        local = seq // world
        cu = torch.tensor([0, local], dtype=torch.int32, device=ctx.device)
        qs = [(q[i], do[i], out_full[i], lse_full[:, i], delta_full[:, i], p) for i, p in shards]
        kvs = [(k[i], v[i], p) for i, p in shards]
        mask = dict(causal=True, cu_seqlens=cu, max_seqlen=local)
        grads = [torch.zeros(local, heads, head_dim, device=ctx.device) for _ in range(3)]
        ring_fwd = partial(_ring_forward_steps, qs, kvs, mask)
        ring_bwd = partial(_ring_backward_steps, qs, kvs, mask, grads)

        params = dict(seq=seq, ring_size=world, heads=heads, head_dim=head_dim, dtype=str(dtype))
        for phase, fn, anchor_s in (("fwd", ring_fwd, mono_fwd_s), ("bwd", ring_bwd, mono_bwd_s)):
            results.append(Result(
                name=f"ring decomposition overhead {phase} P{world} s{seq}", value=ctx.time(fn) * 1e3, unit="ms",
                anchor="one monolithic causal flash_attn over the whole sequence", anchor_value=anchor_s * 1e3,
                higher_is_better=False, params=params,
            ))
    return results


def _ring_tiles() -> list[Result]:
    """Exact tile counts at the GPU ring size (cheap on any device: positions only)."""
    seq = GPU_RING_SEQ
    full_pos = torch.arange(seq, dtype=torch.int32)
    mono_tiles = visited_tiles(full_pos, full_pos)
    results = []
    for world in RING_SIZES:
        shards = zigzag_shards(seq, world, "cpu")
        ring_tiles = sum(visited_tiles(qp, kp) for _, qp in shards for _, kp in shards)
        results.append(Result(
            name=f"ring decomposition tiles (exact) P{world} s{seq}", value=ring_tiles, unit="tiles",
            anchor=f"monolithic causal tiles ({TILE_M}x{TILE_N} blocks)", anchor_value=mono_tiles,
            higher_is_better=False, params=dict(seq=seq, ring_size=world, tile_m=TILE_M, tile_n=TILE_N),
        ))
    return results


def run(ctx: BenchContext) -> list[Result]:
    small = ctx.quick or not ctx.on_gpu
    seqs, tokens, ring_seq = (CPU_SEQS, CPU_TOKENS, CPU_RING_SEQ) if small else (GPU_SEQS, GPU_TOKENS, GPU_RING_SEQ)
    heads, head_dim = (2, 32) if small else (16, 128)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = []
    for seq in seqs:
        results += _bench_seq(ctx, seq, tokens, heads, head_dim, dtype)
    gqa_seq, gqa_heads = (seqs[0], (4, 1)) if small else (4096, (32, 4))
    results += _bench_seq(ctx, gqa_seq, gqa_seq, gqa_heads[0], head_dim, dtype, gqa_heads[1], phases=("fwd+bwd",))
    results += _bench_ring(ctx, ring_seq, CPU_RING_SIZES if small else RING_SIZES, heads, head_dim, dtype)
    return results + _ring_tiles()


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    context = BenchContext(device=device, peaks={}, quick=not torch.cuda.is_available())
    for result in run(context):
        print(f"{result.name:60s} {result.value:10.2f} {result.unit:8s} x{result.ratio:5.2f} vs {result.anchor}")
