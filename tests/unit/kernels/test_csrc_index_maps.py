"""The csrc kernels' index maps and the wrappers' pointer/stride arithmetic, checked without a GPU.

The extension's ``*_host`` entry points run the very same map functors and the same chunk plan
as the CUDA kernels over CPU memory (one memcpy per (row, chunk) item), so a wrong offset, stride,
document lookup or chunk boundary fails here, on CI, against the plain-torch references; the gpu
tests then only have to catch what is GPU-specific (vector widths, lanes). The weighted combine
has a host twin too (the same per-pack fp32 sum). The launch shape itself (how many blocks a copy
gets) is pure host arithmetic and is checked here for the shapes of examples/. The routing sort is
a warp kernel with no host twin: it is covered by the gpu tests only.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.csrc_helpers import require_cuda_ext
from xorl_kernels import cuda_ext
from xorl_kernels.moe_permute.csrc import ext_permute_rows, ext_unpermute_combine
from xorl_kernels.moe_permute.reference import permute_rows_reference, unpermute_combine_reference
from xorl_kernels.ulysses.csrc import (
    ext_ulysses_pack,
    ext_ulysses_pack_reverse,
    ext_ulysses_unpack,
    ext_ulysses_unpack_reverse,
)
from xorl_kernels.ulysses.reference import (
    ulysses_pack_reference,
    ulysses_pack_reverse_reference,
    ulysses_unpack_reference,
    ulysses_unpack_reverse_reference,
)
from xorl_kernels.zigzag.csrc import ext_zigzag_copy
from xorl_kernels.zigzag.reference import zigzag_gather_reference, zigzag_scatter_reference

pytestmark = pytest.mark.skipif(not cuda_ext.has_cuda_ext(), reason="xorl_kernels._C not built (no nvcc)")

ZIGZAG_CASES = [
    # (shape, dim, world, document lengths or None, dtype)
    ((2, 48, 3), 1, 4, None, torch.float32),
    ((3, 2, 16, 5), 2, 2, [4, 0, 8, 4], torch.bfloat16),  # an empty document, 10-byte rows
    ((60, 7), 0, 3, [18, 6, 36], torch.uint8),  # 7-byte rows
    ((40,), 0, 2, [8, 12, 20], torch.int64),
    # Rows longer than one chunk (256 vectors), ending in a partial chunk: 4400-byte rows at 16-byte
    # access, 4102-byte rows at 2-byte access (8 chunks and 6 bytes).
    ((2, 16, 1100), 1, 2, [8, 8], torch.float32),
    ((24, 2051), 0, 3, None, torch.bfloat16),
]


@pytest.mark.parametrize("shape,dim,world,docs,dtype", ZIGZAG_CASES)
def test_zigzag_map_matches_reference(shape, dim, world, docs, dtype):
    gen = torch.Generator().manual_seed(len(shape) * world)
    x = (torch.randn(shape, generator=gen) * 100).to(dtype)
    cu = (
        None if docs is None else torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int64)
    )
    local_len = shape[dim] // world
    for rank_begin, num_ranks in [(r, 1) for r in range(world)] + [(0, world)]:
        rank = rank_begin if num_ranks == 1 else None
        local_shape = list(shape)
        local_shape[dim] = num_ranks * local_len
        local = torch.full(local_shape, 3, dtype=dtype)  # poison
        ext_zigzag_copy(x, local, dim, rank_begin, num_ranks, world, cu, False, host_emulation=True)
        torch.testing.assert_close(local, zigzag_gather_reference(x, dim, rank, world, cu), rtol=0, atol=0)
        full = torch.full(shape, 5, dtype=dtype)  # rows of other ranks must keep this
        ext_zigzag_copy(full, local, dim, rank_begin, num_ranks, world, cu, True, host_emulation=True)
        expected = zigzag_scatter_reference(
            local, dim, rank, world, cu, out=torch.full(shape, 5, dtype=dtype)
        )
        torch.testing.assert_close(full, expected, rtol=0, atol=0)


def test_zigzag_map_never_leaves_the_tensor_on_bad_cu_seqlens():
    x = torch.randn(2, 16)
    local = torch.full((2, 8), 7.0)
    cu = torch.tensor(
        [0, 6, 16]
    )  # document 0 not a multiple of 2*world: the rows may be wrong, never outside
    ext_zigzag_copy(x, local, 1, 0, 1, 2, cu, False, host_emulation=True)
    assert torch.isin(local, torch.cat([x.flatten(), torch.zeros(1)])).all()


@pytest.mark.parametrize(
    "dtype,hidden",
    [(torch.float32, 16), (torch.bfloat16, 7), (torch.uint8, 3), (torch.float32, 1300), (torch.bfloat16, 2051)],
)
def test_permute_rows_map_matches_reference(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(11, hidden, generator=gen) * 50).to(dtype)
    src = torch.randint(-2, 13, (30,), generator=gen)  # some outside [0, 11): zero rows
    out = torch.full((30, hidden), 9, dtype=dtype)
    ext_permute_rows(x, src, out=out, host_emulation=True)
    torch.testing.assert_close(out, permute_rows_reference(x, src), rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seq", [6, 400])  # 400: unpack / pack_reverse rows span 2-5 chunks of 4 KiB
def test_ulysses_maps_match_references(world, dtype, seq):
    gen = torch.Generator().manual_seed(world)
    shapes = [(2, seq, 4 * world, 3), (2, seq, 2 * world, 3), (2, seq, 2 * world, 5)]  # GQA, own V head dim
    xs = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    buf = torch.full((world, sum(t.numel() for t in xs) // world), float("nan"), dtype=dtype)
    ext_ulysses_pack(xs, world, out=buf, host_emulation=True)
    torch.testing.assert_close(buf, ulysses_pack_reference(xs, world), rtol=0, atol=0)

    recv = torch.randn(buf.shape, generator=gen).to(dtype)
    got = ext_ulysses_unpack(recv, world, shapes, host_emulation=True)
    for g, r in zip(got, ulysses_unpack_reference(recv, world, shapes)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)

    rshapes = [(2, seq * world, 3, 3), (2, seq * world, 1, 3), (2, seq * world, 1, 5)]
    ys = [torch.randn(s, generator=gen).to(dtype) for s in rshapes]
    buf = torch.full((world, sum(t.numel() for t in ys) // world), float("nan"), dtype=dtype)
    ext_ulysses_pack_reverse(ys, world, out=buf, host_emulation=True)
    torch.testing.assert_close(buf, ulysses_pack_reverse_reference(ys, world), rtol=0, atol=0)

    recv = torch.randn(buf.shape, generator=gen).to(dtype)
    outs = [torch.full((2, seq, world * s[2], s[3]), float("nan"), dtype=dtype) for s in rshapes]
    ext_ulysses_unpack_reverse(recv, world, rshapes, outs=outs, host_emulation=True)
    for g, r in zip(outs, ulysses_unpack_reverse_reference(recv, world, rshapes)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("hidden", [33, 2056])  # 33: one feature per step; 2056: 16-byte packs, several chunks
def test_unpermute_combine_host_matches_reference(dtype, tol, hidden):
    gen = torch.Generator().manual_seed(hidden)
    tokens, top_k = 37, 6
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    rows = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k)
    rows[::5, 1] = -1  # dropped slots add nothing
    rows[::7, 4] = tokens * top_k  # past the end: nothing either
    w = torch.rand(tokens, top_k, generator=gen)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)  # poison
    ext_unpermute_combine(y, rows, w, out=out, host_emulation=True)
    valid = (rows >= 0) & (rows < y.shape[0])
    expected = (y.double()[rows.clamp(0, y.shape[0] - 1)] * (w.double() * valid).unsqueeze(-1)).sum(1)
    assert torch.isfinite(out).all()
    err = (out.double() - expected).norm() / expected.norm()
    assert err < tol, f"relative error {err}"
    # The fp32 k-order sum (fma in the kernel, mul + add here) differs from it by rounding only.
    torch.testing.assert_close(out, unpermute_combine_reference(y, rows, w), rtol=2 * tol, atol=2 * tol)


def _launch(rows, max_row_bytes, width, sms=132):
    return cuda_ext._C.row_copy_launch(rows, max_row_bytes, width, sms)


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("row_vectors", [1, 3, 32, 255, 256, 257, 4096, 1 << 20])
@pytest.mark.parametrize("rows", [1, 7, 100_000])
def test_row_copy_plan_covers_every_byte_once(width, row_vectors, rows):
    row_bytes = row_vectors * width
    got = _launch(rows, row_bytes, width)
    chunk, per_row = got["chunk_bytes"], got["chunks_per_row"]
    assert chunk % width == 0 and 0 < chunk <= 256 * width
    assert (per_row - 1) * chunk < row_bytes <= per_row * chunk  # the chunks tile the row, none empty
    assert got["lanes"] == min(32, 1 << (chunk // width - 1).bit_length())  # lanes sized to a chunk
    assert got["items"] == rows * per_row
    groups_per_block = 256 // got["lanes"]
    assert 1 <= got["blocks"] <= 16 * 132
    assert got["blocks"] == 16 * 132 or got["blocks"] * groups_per_block >= got["items"]
    assert _launch(0, row_bytes, width)["items"] == 0


# (what, rows, longest row in bytes, access width): the copies of examples/ at their real shapes.
# Before rows were cut into chunks a Ulysses unpack got one warp per row: 12 rows (3 blocks) for
# Qwen3-30B-A3B, a few % of HBM bandwidth.
EXAMPLE_COPIES = [
    # qwen3_30b_a3b_pp2_ep4_cp4: Ulysses 4, 32768 tokens, 32 q / 4 kv heads (replicated to 4), d 128,
    # bf16: unpack and pack_reverse move P x batch rows per tensor, the longest 8192 * 8 * 128 * 2 B.
    ("qwen3-30b ulysses unpack", 3 * 4, 8192 * 8 * 128 * 2, 16),
    ("qwen3-30b ulysses pack", 3 * 8192 * 4, 8 * 128 * 2, 16),
    # qwen3_235b_a22b_ep64_ulysses64: 65536 tokens over 64 ranks, 1 head of each per rank.
    ("qwen3-235b ulysses unpack", 3 * 64, 1024 * 128 * 2, 16),
    # bench_data_movement's Llama-8B-like Ulysses 8: 8192 tokens per rank, 32 / 8 / 8 heads.
    ("llama-8b ulysses unpack", 3 * 8, 8192 * 4 * 128 * 2, 16),
    # llama3_8b_128k_fsdp_ring4: zig-zag gather of [131072, 4096] bf16 hidden states, 4 ranks.
    ("llama-8b-128k zigzag", 131072 // 4, 4096 * 2, 16),
    # qwen3_30b: permute 8192 tokens x top-8 rows of hidden 2048 bf16; the combine in 16-byte packs.
    ("qwen3-30b permute", 8192 * 8, 2048 * 2, 16),
    ("qwen3-30b unpermute combine", 8192, 2048 * 2 // 16, 1),
]


@pytest.mark.parametrize("what,rows,row_bytes,width", EXAMPLE_COPIES, ids=[c[0] for c in EXAMPLE_COPIES])
def test_example_copies_fill_an_h100(what, rows, row_bytes, width):
    """At least 4 blocks of 256 threads per SM (1024 threads, each with 4 16-byte loads in flight:
    64 KiB per SM, above what HBM3 needs to run at full speed), every group of 32 lanes busy."""
    got = _launch(rows, row_bytes, width, sms=132)
    assert got["blocks"] >= 4 * 132, got
    assert got["lanes"] == 32, got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [4104, 33])  # 16-byte packs over 2-3 chunks; one feature per step
def test_gpu_combine_equals_its_host_twin(dtype, hidden):
    """Bit for bit: the same fmaf chain in k order and the same conversions on both sides, so the
    CPU tests of the host twin above speak for the GPU kernel."""
    require_cuda_ext()
    gen = torch.Generator().manual_seed(hidden)
    tokens, top_k = 301, 8
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    rows = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k)
    rows[::3, 5] = -1
    w = torch.rand(tokens, top_k, generator=gen)
    host = ext_unpermute_combine(y, rows, w, out=torch.full((tokens, hidden), float("nan"), dtype=dtype),
                                      host_emulation=True)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device="cuda")
    ext_unpermute_combine(y.cuda(), rows.cuda(), w.cuda(), out=out)
    assert torch.equal(out.cpu(), host)
