"""The csrc kernels' index maps and the wrappers' pointer/stride arithmetic, checked without a GPU.

The extension's ``*_host`` entry points run the very same map functors as the CUDA kernels over
CPU memory (one memcpy per row), so a wrong offset, stride or document lookup fails here, on CI,
against the plain-torch references; the gpu tests then only have to catch what is GPU-specific
(vector widths, lanes, launch shapes). The routing sort and the weighted combine are warp/fp32
kernels with no host twin: they are covered by the gpu tests only.
"""

from __future__ import annotations

import pytest
import torch

from xorl_kernels import _ext
from xorl_kernels.routing_metadata import permute_rows_reference
from xorl_kernels.ulysses_transpose import (
    ulysses_pack_reference,
    ulysses_pack_reverse_reference,
    ulysses_unpack_reference,
    ulysses_unpack_reverse_reference,
)
from xorl_kernels.zigzag_gather import zigzag_gather_reference, zigzag_scatter_reference

pytestmark = pytest.mark.skipif(not _ext.has_cuda_ext(), reason="xorl_kernels._C not built (no nvcc)")

ZIGZAG_CASES = [
    # (shape, dim, world, document lengths or None, dtype)
    ((2, 48, 3), 1, 4, None, torch.float32),
    ((3, 2, 16, 5), 2, 2, [4, 0, 8, 4], torch.bfloat16),  # an empty document, 10-byte rows
    ((60, 7), 0, 3, [18, 6, 36], torch.uint8),  # 7-byte rows
    ((40,), 0, 2, [8, 12, 20], torch.int64),
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
        _ext.ext_zigzag_copy(x, local, dim, rank_begin, num_ranks, world, cu, False, host_emulation=True)
        torch.testing.assert_close(local, zigzag_gather_reference(x, dim, rank, world, cu), rtol=0, atol=0)
        full = torch.full(shape, 5, dtype=dtype)  # rows of other ranks must keep this
        _ext.ext_zigzag_copy(full, local, dim, rank_begin, num_ranks, world, cu, True, host_emulation=True)
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
    _ext.ext_zigzag_copy(x, local, 1, 0, 1, 2, cu, False, host_emulation=True)
    assert torch.isin(local, torch.cat([x.flatten(), torch.zeros(1)])).all()


@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 16), (torch.bfloat16, 7), (torch.uint8, 3)])
def test_permute_rows_map_matches_reference(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(11, hidden, generator=gen) * 50).to(dtype)
    src = torch.randint(-2, 13, (30,), generator=gen)  # some outside [0, 11): zero rows
    out = torch.full((30, hidden), 9, dtype=dtype)
    _ext.ext_permute_rows(x, src, out=out, host_emulation=True)
    torch.testing.assert_close(out, permute_rows_reference(x, src), rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ulysses_maps_match_references(world, dtype):
    gen = torch.Generator().manual_seed(world)
    shapes = [(2, 6, 4 * world, 3), (2, 6, 2 * world, 3), (2, 6, 2 * world, 5)]  # GQA, own V head dim
    xs = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    buf = torch.full((world, sum(t.numel() for t in xs) // world), float("nan"), dtype=dtype)
    _ext.ext_ulysses_pack(xs, world, out=buf, host_emulation=True)
    torch.testing.assert_close(buf, ulysses_pack_reference(xs, world), rtol=0, atol=0)

    recv = torch.randn(buf.shape, generator=gen).to(dtype)
    got = _ext.ext_ulysses_unpack(recv, world, shapes, host_emulation=True)
    for g, r in zip(got, ulysses_unpack_reference(recv, world, shapes)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)

    rshapes = [(2, 4 * world, 3, 3), (2, 4 * world, 1, 3), (2, 4 * world, 1, 5)]
    ys = [torch.randn(s, generator=gen).to(dtype) for s in rshapes]
    buf = _ext.ext_ulysses_pack_reverse(ys, world, host_emulation=True)
    torch.testing.assert_close(buf, ulysses_pack_reverse_reference(ys, world), rtol=0, atol=0)

    recv = torch.randn(buf.shape, generator=gen).to(dtype)
    outs = [torch.full((2, 4, world * s[2], s[3]), float("nan"), dtype=dtype) for s in rshapes]
    _ext.ext_ulysses_unpack_reverse(recv, world, rshapes, outs=outs, host_emulation=True)
    for g, r in zip(outs, ulysses_unpack_reverse_reference(recv, world, rshapes)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
