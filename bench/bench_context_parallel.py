"""Context parallelism: zig-zag work balance (exact, any device) and the Ulysses transposes (GB/s).

1. Causal attention work per rank — token pairs (q, k) with k_pos <= q_pos in the same document —
   counted exactly for the zig-zag layout against a contiguous split of the same sequence, P = 2..16,
   on one long document and on packed documents of uneven (padded) lengths. Reported as max/mean
   over ranks (1.00 = perfectly balanced), both for the whole attention and for the worst single
   ring step (a ring step waits for its slowest rank). Zig-zag must be exactly 1.00.
2. Ulysses sequence <-> head transposes as UlyssesAttention runs them (KV-head replication when
   the Ulysses size exceeds the KV heads, then one pack of Q, K and V into the all-to-all buffer;
   the unpack after it; the same for the output), in GB/s of bytes read + written, against a
   device-to-device copy of the same bytes (target >= 0.85). GPU: s_local 8192, 32 query heads,
   8 or 4 KV heads, head_dim 128, bf16, Ulysses 8. CPU / quick: tiny shapes.
"""

from __future__ import annotations

import torch

from bench.context import BenchContext, Result
from xorl.distributed.zigzag import zigzag_local_indices
from xorl.nn.ulysses_attention import kv_head_index
from xorl_kernels.dispatch import CSRC, REFERENCE, pick_backend
from xorl_kernels.ulysses.op import (
    ulysses_pack,
    ulysses_pack_reverse,
    ulysses_unpack,
    ulysses_unpack_reverse,
)

RING_SIZES = (2, 4, 8, 16)


# ----------------------------------------------------------------------------------------------
# 1. work balance (exact integer counts)
# ----------------------------------------------------------------------------------------------
def _doc_and_position(cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    position = torch.arange(cu[-1]) - torch.tensor(cu[:-1])[doc]
    return doc, position


def _pairs(q_idx, k_idx, doc, position) -> int:
    """Causal (q, k) pairs between two token sets of the global sequence."""
    same_doc = doc[q_idx][:, None] == doc[k_idx][None, :]
    visible = position[k_idx][None, :] <= position[q_idx][:, None]
    return int((same_doc & visible).sum())


def _balance(blocks: list[torch.Tensor], doc, position) -> tuple[float, float]:
    """(max/mean of total work per rank, worst ring step's max/mean) for these per-rank blocks."""
    size = len(blocks)
    totals = [0] * size
    worst_step = 1.0
    for step in range(size):
        work = [_pairs(blocks[r], blocks[(r - step) % size], doc, position) for r in range(size)]
        totals = [t + w for t, w in zip(totals, work)]
        mean = sum(work) / size
        worst_step = max(worst_step, max(work) / mean if mean else 1.0)
    return max(totals) / (sum(totals) / size), worst_step


def balance_results() -> list[Result]:
    results = []
    for size in RING_SIZES:
        chunk = 2 * size
        layouts = {
            "one document": [0, 64 * chunk],
            # Uneven documents, each padded to a multiple of 2P as prepare_context_parallel_batch does.
            "packed uneven documents": [0, *torch.tensor([9, 3, 17, 1, 6]).mul(chunk).cumsum(0).tolist()],
        }
        for layout, cu in layouts.items():
            doc, position = _doc_and_position(cu)
            total = cu[-1]
            zigzag = [zigzag_local_indices(total, cu, (r, size)) for r in range(size)]
            contiguous = list(torch.arange(total).chunk(size))
            zz_total, zz_step = _balance(zigzag, doc, position)
            ct_total, ct_step = _balance(contiguous, doc, position)
            params = {"ring_size": size, "tokens": total, "layout": layout, "exact": True}
            results.append(
                Result(
                    f"causal work per rank max/mean, zig-zag, P={size}, {layout}",
                    zz_total,
                    "x",
                    "contiguous split",
                    ct_total,
                    higher_is_better=False,
                    params=params,
                )
            )
            results.append(
                Result(
                    f"worst ring step work max/mean, zig-zag, P={size}, {layout}",
                    zz_step,
                    "x",
                    "contiguous split",
                    ct_step,
                    higher_is_better=False,
                    params=params,
                )
            )
    return results


# ----------------------------------------------------------------------------------------------
# 2. Ulysses transposes as the module runs them
# ----------------------------------------------------------------------------------------------
def _copy_gbps(ctx: BenchContext, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / ctx.time(lambda: dst.copy_(src)) / 1e9


def _result(ctx, name, fn, moved_bytes, params) -> Result:
    gbps = 2.0 * moved_bytes / ctx.time(fn) / 1e9
    peak = ctx.peaks.get("copy_gbps")
    return Result(
        name,
        gbps,
        "GB/s",
        "device copy of the same bytes",
        _copy_gbps(ctx, moved_bytes),
        peak_fraction=gbps / peak if peak else None,
        params=params,
    )


def _ulysses_config(ctx: BenchContext, seq_local, heads, kv_heads, head_dim, world, dtype) -> list[Result]:
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q = torch.randn(1, seq_local, heads, head_dim, device=ctx.device, generator=g).to(dtype)
    k = torch.randn(1, seq_local, kv_heads, head_dim, device=ctx.device, generator=g).to(dtype)
    v = torch.randn_like(k)
    index = kv_head_index(heads, kv_heads, world)
    index = None if index is None else index.to(ctx.device)

    def pack():
        kk, vv = (k, v) if index is None else (k.index_select(2, index), v.index_select(2, index))
        return ulysses_pack([q, kk, vv], world)

    send = pack()
    kv_sent = kv_heads if index is None else world
    shapes = [tuple(q.shape), (1, seq_local, kv_sent, head_dim), (1, seq_local, kv_sent, head_dim)]
    out = torch.randn(1, seq_local * world, heads // world, head_dim, device=ctx.device, generator=g).to(dtype)
    out_send = ulysses_pack_reverse([out], world)
    tag = f"s{seq_local} h{heads}/{kv_heads} d{head_dim} U{world}"
    params = {
        "seq_local": seq_local,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "world": world,
        "dtype": str(dtype),
        "kv_replicated": index is not None,
        "csrc": pick_backend("ulysses_pack", [q], (CSRC, REFERENCE)) == CSRC,
    }
    buf = send.numel() * send.element_size()
    out_buf = out_send.numel() * out_send.element_size()
    return [
        _result(ctx, f"ulysses q/k/v -> all-to-all buffer (replicate + pack) {tag}", pack, buf, params),
        _result(
            ctx,
            f"ulysses all-to-all buffer -> q/k/v (unpack) {tag}",
            lambda: ulysses_unpack(send, world, shapes),
            buf,
            params,
        ),
        _result(
            ctx,
            f"ulysses out -> all-to-all buffer (pack) {tag}",
            lambda: ulysses_pack_reverse([out], world),
            out_buf,
            params,
        ),
        _result(
            ctx,
            f"ulysses all-to-all buffer -> out (unpack) {tag}",
            lambda: ulysses_unpack_reverse(out_send, world, [tuple(out.shape)]),
            out_buf,
            params,
        ),
    ]


def ulysses_results(ctx: BenchContext) -> list[Result]:
    big = ctx.on_gpu and not ctx.quick
    seq_local, heads, head_dim, world = (8192, 32, 128, 8) if big else (128, 8, 16, 4)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    results = []
    for kv_heads in (8, 4) if big else (4, 2):  # split, then replicated (fewer KV heads than ranks)
        results += _ulysses_config(ctx, seq_local, heads, kv_heads, head_dim, world, dtype)
    return results


def run(ctx: BenchContext) -> list[Result]:
    return balance_results() + ulysses_results(ctx)
