"""Tile audit of the zig-zag ring with a sliding window: the Triton kernels' own tile counter
(xorl_kernels.attention.common.count_tiles) over every step of every rank, against one monolithic
windowed attention and against the tiles that lie inside the window band.

S = 4096, W = 128, P = 4, one head: each rank's steps run in this process, in the ring's order,
through the ring's own step kernel (positions, window, and the static skip of steps outside
every local window). Block sizes are the kernels' own (read from their autotune configs; on CPU,
under the interpreter: forward and dQ programs own 32 query rows and loop over 16-key tiles,
dK/dV programs own 32 keys and loop over 16-query tiles), and the band count uses the same sizes.

Why the tile math is stubbed out: the interpreter spends ~30 ms per tile on numpy, and the audit
visits ~16,000 tiles. The loop bounds, the per-tile visibility checks (positions only) and the
counter are the kernels' own and run unchanged; only the function that does one tile's
arithmetic returns its accumulators untouched. The numbers these tiles compute are checked
elsewhere (tests/test_ring_attention.py: ring P = 2, 4 with windows against float64).

Measured (CPU, interpreter blocks): band 1260 tiles for each of forward, dK/dV and dQ; one
monolithic windowed attention visits 1260 / 1260 / 1260; the ring's 10 computed steps (of 16)
visit 1260 / 1260 / 1260 in all.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_helpers import to_triton
from xorl.nn.ring_attention import ZigzagStepKernel, _active_steps
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


@pytest.fixture
def tile_math_stubbed(monkeypatch):
    """On CPU (interpreter): one tile's arithmetic returns its accumulators unchanged (see above)."""
    if torch.cuda.is_available():
        return
    from xorl_kernels.attention import bwd_triton, fwd_triton

    monkeypatch.setattr(fwd_triton, "_fwd_block", lambda acc, l_i, m_i, *rest: (acc, l_i, m_i))
    monkeypatch.setattr(bwd_triton, "_dkdv_block", lambda dk_a, dk_b, dv, *rest: (dk_a, dk_b, dv))
    monkeypatch.setattr(bwd_triton, "_dq_block", lambda dq_a, dq_b, *rest: (dq_a, dq_b))


def _blocks(kernel) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a kernel's first autotune config (the only one under the interpreter)."""
    config = kernel.configs[0].kwargs
    return config["BLOCK_M"], config["BLOCK_N"]


def _monolithic(q, k, v, do):
    def run():
        out, lse = flash_attn_forward(q, k, v, causal=True, window=W, backend="triton")
        delta = flash_attn_bwd_preprocess(out, do)
        grads = flash_attn_backward(do, q, k, v, out, lse, delta, causal=True, window=W, backend="triton")
        return out, grads

    return _counted(run, q.device)


def _ring(q, k, v, do, scale):
    """Every rank's ring steps, forward then backward: (tiles [fwd, dkdv, dq], steps computed)."""
    positions = zigzag_positions(S, None, P, None, within_document=True).view(P, S // P)
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
            outs.append((out_acc, lse_acc))
        dq = [torch.zeros_like(q_r, dtype=torch.float32) for q_r, *_ in shard]
        dk = [torch.zeros_like(k_r, dtype=torch.float32) for _, k_r, *_ in shard]
        dv = [torch.zeros_like(v_r, dtype=torch.float32) for _, _, v_r, _ in shard]
        for r in range(P):
            out, lse = outs[r]
            delta = flash_attn_bwd_preprocess(out, shard[r][3])
            for j in range(P):
                if kernel.has_work(r, j):
                    kernel.backward(shard[r][3], shard[r][0], shard[j][1], shard[j][2], out, lse, delta, r, j,
                                    dq[r], dk[j], dv[j])  # fmt: skip
        return steps

    return _counted(run, q.device)


@pytest.mark.slow  # ~2 CPU-minutes of interpreter loop bounds (S = 4096 at P = 4, three kernels)
def test_windowed_zigzag_ring_visits_the_tiles_of_one_monolithic_attention(tile_math_stubbed):
    from xorl_kernels.attention import bwd_triton, fwd_triton

    g = torch.Generator().manual_seed(0)
    q, k, v, do = to_triton(*(torch.randn(1, S, 1, D, generator=g) for _ in range(4)))
    mono_tiles, _ = _monolithic(q, k, v, do)
    ring_tiles, steps = _ring(q, k, v, do, D**-0.5)

    fwd_m, fwd_n = _blocks(fwd_triton._flash_attn_fwd_kernel)
    dkdv_m, dkdv_n = _blocks(bwd_triton._flash_attn_bwd_dkdv_kernel)
    dq_m, dq_n = _blocks(bwd_triton._flash_attn_bwd_dq_kernel)
    band = [_band_tiles(fwd_m, fwd_n, True), _band_tiles(dkdv_n, dkdv_m, False), _band_tiles(dq_m, dq_n, True)]
    print(f"S={S} W={W} P={P}, blocks fwd {fwd_m}x{fwd_n}, dkdv {dkdv_n} keys x {dkdv_m}, dq {dq_m}x{dq_n}: "
          f"band tiles {band}, monolithic {mono_tiles}, ring {ring_tiles}, ring steps computed {steps}/16")
    assert ring_tiles == mono_tiles, (ring_tiles, mono_tiles)
    for kind, visited, inside in zip(("forward", "dK/dV", "dQ"), mono_tiles, band):
        assert inside <= visited <= 1.1 * inside, f"{kind}: {visited} tiles visited, {inside} in the band"
    # Chunks of 512 > W: a step is needed only between a chunk and the one just before it
    # (rank r: its own block and ranks r-1, r+1 where they exist: 2 + 3 + 3 + 2).
    assert steps == 10, steps
