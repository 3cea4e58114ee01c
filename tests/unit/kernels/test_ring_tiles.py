"""Tile audit of the zig-zag ring with a sliding window: the Triton kernels' own tile counter
(xorl_kernels.attention.common.count_tiles) over every step of every rank, against one monolithic
windowed attention and against the tiles that lie inside the window band.

S = 4096, W = 128, P = 4, one head: each rank's steps run in this process, in the ring's order,
through the ring's own step kernel (positions, window, and the static skip of steps outside
every local window), with the real arithmetic: the ring's merged outputs and accumulated
gradients are checked against the monolithic ones too. Block size: 128 x 64, the GPU forward
shape, forced as the kernels' one autotune config (forward and dQ programs own 128 query rows and
loop over 64-key tiles; dK/dV programs own 128 keys and loop over 64-row query tiles); the band
count uses the same sizes. (tests/unit/kernels/test_attention_features.py audits the monolithic kernels alone,
also at the interpreter's 32 x 16.)

Measured (CPU, interpreter): band 126 tiles for each of forward, dK/dV and dQ; one monolithic
windowed attention visits 126 / 126 / 126; the ring's 10 computed steps (of 16) visit
126 / 126 / 126 in all.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_helpers import to_triton
from xorl.nn.ring_step_kernel import ZigzagStepKernel, _active_steps
from xorl_kernels.attention.merge import merge_attn_states
from xorl_kernels.attention.op import flash_attn_backward, flash_attn_bwd_preprocess, flash_attn_forward
from xorl_kernels.zigzag.layout import zigzag_positions
from xorl_kernels.zigzag.op import zigzag_gather

S, W, P, D = 4096, 128, 4, 16


def _band_tiles(rows_per_block: int, cols_per_tile: int, by_query: bool) -> int:
    """Tiles holding at least one (query p, key k) pair with p - W < k <= p, for blocks of
    ``rows_per_block`` queries (by_query) or keys, each looping over tiles of the other side."""
    tiles = 0
    for start in range(0, S, rows_per_block):
        end = start + rows_per_block - 1
        if by_query:  # keys seen by queries start..end
            lo, hi = max(0, start - W + 1), end
        else:  # queries that see keys start..end
            lo, hi = start, min(S - 1, end + W - 1)
        tiles += hi // cols_per_tile - lo // cols_per_tile + 1
    return tiles


def _counted(fn, device):
    from xorl_kernels.attention.common import count_tiles

    with count_tiles(device) as tiles:
        result = fn()
    return tiles.tolist(), result


def _one_config(monkeypatch, kernel, **blocks):
    """Run an autotuned kernel with exactly one block shape (the audit states its block size)."""
    import triton

    monkeypatch.setattr(kernel, "configs", [triton.Config(blocks, num_warps=4, num_stages=1)])


def _monolithic(q, k, v, do):
    def run():
        out, lse = flash_attn_forward(q, k, v, causal=True, window=W, backend="triton")
        delta = flash_attn_bwd_preprocess(out, do)
        grads = flash_attn_backward(do, q, k, v, out, lse, delta, causal=True, window=W, backend="triton")
        return out, grads

    return _counted(run, q.device)


def _ring(q, k, v, do, scale):
    """Every rank's ring steps, forward then backward, as RingAttention runs them:
    (tiles [fwd, dkdv, dq], (steps computed, out, (dq, dk, dv) in zig-zag row order))."""
    positions = zigzag_positions(S, None, P, None, within_document=True).view(P, S // P).to(q.device)
    kernel = ZigzagStepKernel(P, True, scale, None, S // P, positions, "triton", W)
    kernel.active = _active_steps(None, P, S // P, W)
    shard = [[zigzag_gather(t, 1, r, P).contiguous() for t in (q, k, v, do)] for r in range(P)]

    def run():
        outs, steps = [], 0
        for r in range(P):
            out_acc = lse_acc = None
            for step in range(P):
                j = (r - step) % P
                if kernel.has_work(r, j):
                    steps += 1
                    out, lse = kernel.forward(shard[r][0], shard[j][1], shard[j][2], r, j)
                    out_acc, lse_acc = (out.float(), lse) if out_acc is None else merge_attn_states(
                        out_acc, lse_acc, out, lse)  # fmt: skip
            outs.append((out_acc.to(q.dtype), lse_acc))
        grads = [[torch.zeros_like(t, dtype=torch.float32) for t in shard[r][:3]] for r in range(P)]
        for r in range(P):
            out, lse = outs[r]
            delta = flash_attn_bwd_preprocess(out, shard[r][3])
            for step in range(P):
                j = (r - step) % P
                if kernel.has_work(r, j):
                    kernel.backward(shard[r][3], shard[r][0], shard[j][1], shard[j][2], out, lse, delta, r, j,
                                    grads[r][0], grads[j][1], grads[j][2])  # fmt: skip
        out = torch.cat([o for o, _ in outs], dim=1)
        return steps, out, [torch.cat([g[i] for g in grads], dim=1) for i in range(3)]

    return _counted(run, q.device)


@pytest.mark.slow  # ~11 s of Triton interpreter: the full suite's, not the quick tier's
def test_windowed_zigzag_ring_visits_the_tiles_of_one_monolithic_attention(monkeypatch):
    from xorl_kernels.attention import bwd_triton, fwd_triton

    block_m, block_n = 128, 64
    _one_config(monkeypatch, fwd_triton._flash_attn_fwd_kernel, BLOCK_M=block_m, BLOCK_N=block_n)
    _one_config(monkeypatch, bwd_triton._flash_attn_bwd_dq_kernel, BLOCK_M=block_m, BLOCK_N=block_n)
    _one_config(monkeypatch, bwd_triton._flash_attn_bwd_dkdv_kernel, BLOCK_N=block_m, BLOCK_M=block_n)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = to_triton(*(torch.randn(1, S, 1, D, generator=g) for _ in range(4)))
    mono_tiles, (mono_out, mono_grads) = _monolithic(q, k, v, do)
    ring_tiles, (steps, ring_out, ring_grads) = _ring(q, k, v, do, D**-0.5)

    band = [_band_tiles(block_m, block_n, True), _band_tiles(block_m, block_n, False),
            _band_tiles(block_m, block_n, True)]  # forward, dK/dV, dQ  # fmt: skip
    print(f"S={S} W={W} P={P}, blocks {block_m}x{block_n}: band tiles {band}, monolithic {mono_tiles}, "
          f"ring {ring_tiles}, ring steps computed {steps}/16")
    assert ring_tiles == mono_tiles, (ring_tiles, mono_tiles)
    for kind, visited, inside in zip(("forward", "dK/dV", "dQ"), mono_tiles, band):
        assert inside <= visited <= 1.1 * inside, f"{kind}: {visited} tiles visited, {inside} in the band"
    # Chunks of 512 > W: a step is needed only between a chunk and the one just before it
    # (rank r: its own block and ranks r-1, r+1 where they exist: 2 + 3 + 3 + 2).
    assert steps == 10, steps
    # The audited tiles computed the attention: the ring's results are the monolithic ones.
    order = zigzag_positions(S, None, P, None).to(q.device)
    for got, want in zip([ring_out, *ring_grads], [mono_out, *mono_grads]):
        want = want[:, order].float()
        assert (got.float() - want).norm() <= 1e-5 * want.norm()
