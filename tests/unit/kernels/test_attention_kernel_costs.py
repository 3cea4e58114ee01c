"""The windowed Triton kernels' cost and code generation: tile audits (the kernels' own counters
against the tiles that meet the window band), the bound search they use, and a compile to sm_90
machine code without a GPU. Correctness against the float64 oracle (tests/support/attention_oracle.py):
tests/unit/kernels/test_attention_features.py.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.support.attention_oracle import dense_attention, docs, rel_err
from tests.support.triton_helpers import triton_device
from xorl_kernels.attention import common
from xorl_kernels.attention.bounds import sorted_count_at_most
from xorl_kernels.attention.op import flash_attn_backward, flash_attn_bwd_preprocess, flash_attn_forward

# -- tile audit: a windowed attention costs about S·W, not S² ------------------------------------


def band_tiles(q_pos, k_pos, window, block_q, block_k) -> int:
    """(query block, key block) tiles holding at least one visible pair p - W < k <= p (exact, dense)."""
    allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    nq, nk = -(-q_pos.numel() // block_q), -(-k_pos.numel() // block_k)
    padded = torch.zeros(nq * block_q, nk * block_k, dtype=torch.bool)
    padded[: q_pos.numel(), : k_pos.numel()] = allowed
    return int(padded.view(nq, block_q, nk, block_k).any(3).any(1).sum())


def _one_config(monkeypatch, kernel, **blocks):
    """Run an autotuned kernel with exactly one block shape (the audit states its block size)."""
    import triton

    monkeypatch.setattr(kernel, "configs", [triton.Config(blocks, num_warps=4, num_stages=1)])


@pytest.mark.parametrize("seq, block_m, block_n", [(4096, 128, 64), (1024, 32, 16)])
def test_window_tile_audit(monkeypatch, seq, block_m, block_n):
    """W = 128, causal, one document: the kernels' own tile counters (common.count_tiles,
    incremented inside the kernels per computed tile) against the tiles that meet the window band.
    S = 4096 at 128x64 blocks (the GPU's forward shape), and S = 1024 at the interpreter's 32x16
    (S = 4096 at 32x16 passed the same bounds once but takes 2 minutes under the interpreter).
    Forward and dQ: BLOCK_M x BLOCK_N = block_m x block_n; the dK/dV kernel owns block_m keys and
    loops over block_n query rows. Measured: every count equals the band exactly (ratio 1.00;
    bound 1.1): S = 4096 at 128x64, 126 tiles (a full causal attention: 1056); S = 1024 at 32x16,
    300 tiles (causal: 1056)."""
    from xorl_kernels.attention import bwd_triton, fwd_triton

    device = triton_device()
    window, heads = 128, 1
    _one_config(monkeypatch, fwd_triton._flash_attn_fwd_kernel, BLOCK_M=block_m, BLOCK_N=block_n)
    _one_config(monkeypatch, bwd_triton._flash_attn_bwd_dq_kernel, BLOCK_M=block_m, BLOCK_N=block_n)
    _one_config(monkeypatch, bwd_triton._flash_attn_bwd_dkdv_kernel, BLOCK_N=block_m, BLOCK_M=block_n)
    gen = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(1, seq, heads, 16, generator=gen).to(device) for _ in range(4))
    with common.count_tiles(device) as tiles:
        out, lse = flash_attn_forward(q, k, v, causal=True, window=window, backend="triton")
        delta = flash_attn_bwd_preprocess(out, do, backend="triton")
        flash_attn_backward(do, q, k, v, out, lse, delta, causal=True, window=window, backend="triton")
    fwd, dkdv, dq = tiles.tolist()
    pos = torch.arange(seq)
    band = heads * band_tiles(pos, pos, window, block_m, block_n)
    band_kv = heads * band_tiles(pos, pos, window, block_n, block_m)  # dK/dV tiles: block_n query rows
    assert band <= fwd <= 1.1 * band, (fwd, band)
    assert band <= dq <= 1.1 * band, (dq, band)
    assert band_kv <= dkdv <= 1.1 * band_kv, (dkdv, band_kv)
    print(f"S={seq} W={window} blocks {block_m}x{block_n}: fwd {fwd} dq {dq} dkdv {dkdv} tiles; band {band} "
          f"(dkdv {band_kv}); full causal {heads * band_tiles(pos, pos, seq, block_m, block_n)}")


def test_window_tile_audit_zigzag_positions():
    """The bounds come from positions: a zig-zag shard (rank 1 of 4: chunks 1 and 6 of one document
    of 1024) against every key of the document, W = 40, also visits only band tiles."""
    device = triton_device()
    seq, world, rank, window = 1024, 4, 1, 40
    chunk = seq // (2 * world)
    q_pos = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * world - 1 - rank)])
    k_pos = torch.arange(seq)
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(q_pos.numel(), 1, 16, generator=gen)
    k, v = (torch.randn(seq, 1, 16, generator=gen) for _ in range(2))
    cu_q, cu_k = docs(q_pos.numel()), docs(seq)
    args = [t.to(device) for t in (q, k, v)]
    kw = dict(causal=True, window=window, cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
              q_positions=q_pos.int().to(device), k_positions=k_pos.int().to(device), backend="triton")
    with common.count_tiles(device) as tiles:
        out, lse = flash_attn_forward(*args, **kw)
    band = band_tiles(q_pos, k_pos, window, 32, 16) if device.type == "cpu" else None
    if band is not None:  # the interpreter's one 32x16 config; on a GPU the tuned shape is not known here
        assert band <= int(tiles[0]) <= 1.1 * band, (int(tiles[0]), band)
    ref_out, _ = dense_attention(q.double(), k.double(), v.double(), torch.zeros(q_pos.numel()), torch.zeros(seq),
                                 q_pos, k_pos, True, 0.25, window)
    assert rel_err(out, ref_out) < 1e-5


@triton.jit
def _search_kernel(POS, THR, OUT, start, length, SCAN: tl.constexpr):
    i = tl.program_id(0)
    tl.store(OUT + i, sorted_count_at_most(POS, start, length, tl.load(THR + i), SCAN))


def test_sorted_count_at_most_matches_searchsorted():
    """The windowed kernels' bound search (bounds.sorted_count_at_most, a SCAN-ary search) against
    torch.searchsorted on non-decreasing positions with repeats, thresholds below, inside and above
    the range, lengths from 0 to several SCAN-fold narrowings, at an offset into the tensor."""
    device = triton_device()
    gen = torch.Generator().manual_seed(23)
    for length in (0, 1, 5, 64, 65, 700, 5000):
        pos = torch.randint(0, 4, (length + 7,), generator=gen).cumsum(0).int()  # repeats: steps of 0
        pos = torch.cat([torch.tensor([99999], dtype=torch.int32), pos])  # start = 1: the offset is honoured
        seg = pos[1 : 1 + length]
        thr = torch.randint(-3, int(seg[-1]) + 4 if length else 3, (40,), generator=gen).int()
        thr = torch.cat([thr, seg[:3], torch.tensor([-(2**30), 2**30], dtype=torch.int32)])
        out = torch.full(thr.shape, -1, dtype=torch.int32)
        pos_d, thr_d, out_d = (t.to(device) for t in (pos, thr, out))
        for scan in (16, 64):
            _search_kernel[(thr.numel(),)](pos_d, thr_d, out_d, 1, length, SCAN=scan)
            expected = torch.searchsorted(seg.long(), thr.long(), right=True)
            assert torch.equal(out_d.cpu().long(), expected), (length, scan)


COMPILE_CHECK = r'''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from xorl_kernels.attention import bwd_dq_triton, bwd_triton, fwd_triton
from xorl_kernels.attention.common import block_head_dim, qk_chunks

flags = dict(**qk_chunks(192), HEAD_V=128, BLOCK_V=block_head_dim(128), IS_CAUSAL=True, HAS_POS=True,
             HAS_WINDOW=True, COUNT_TILES=True, DOT_PREC="tf32", UPCAST=False, SCAN=1024)
pointers = {**dict.fromkeys(["Q", "K", "V", "O", "DO", "DQ", "DK", "DV"], "*bf16"),
            **dict.fromkeys(["LSE", "DELTA", "SINKS"], "*fp32"),
            **dict.fromkeys(["CU_Q", "CU_K", "QPOS", "KPOS", "TILES"], "*i32"),
            "sm_scale": "fp32", "sm_scale_log2": "fp32"}
for kernel, extra in ((fwd_triton._flash_attn_fwd_kernel, dict(HAS_SINKS=True)),
                      (bwd_triton._flash_attn_bwd_dkdv_kernel, dict(ACCUMULATE=True)),
                      (bwd_dq_triton._flash_attn_bwd_dq_kernel, dict(ACCUMULATE=True))):
    fn = kernel.fn
    consts = {**flags, **extra, "BLOCK_M": 64, "BLOCK_N": 32}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton_compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("compiled", fn.__name__)
'''


@pytest.mark.slow  # starts a process (conftest: tests that start processes carry `slow`)
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter runs the kernels as Python and would not see a code-generation error (a
    loop-carried type change, an unsupported construct): compile the three kernels with every new
    feature on (d 192/128 in two q·k chunks, positions, window, sinks, tile counter) to sm_90 machine
    code through Triton's own compiler and ptxas, which needs no GPU. A subprocess, because this
    process imported Triton in interpreter mode."""
    import os
    import subprocess
    import sys

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 3
