"""Zig-zag shard gather/scatter: the reference against explicit chunk/cat, and the csrc kernel against it."""

from __future__ import annotations

import pytest
import torch

from tests.support.csrc_helpers import require_cuda_ext
from xorl_kernels.zigzag.op import zigzag_gather, zigzag_scatter
from xorl_kernels.zigzag.reference import zigzag_gather_reference, zigzag_scatter_reference


def explicit_shard(x: torch.Tensor, dim: int, rank: int, world: int, doc_lengths: list[int]) -> torch.Tensor:
    """Rank's shard written out the long way: per document, chunk into 2*world and take r and 2w-1-r."""
    pieces, start = [], 0
    for length in doc_lengths:
        doc = x.narrow(dim, start, length)
        c = length // (2 * world)
        pieces.append(doc.narrow(dim, rank * c, c))
        pieces.append(doc.narrow(dim, (2 * world - 1 - rank) * c, c))
        start += length
    return torch.cat(pieces, dim=dim)


def cu_of(doc_lengths: list[int], dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(doc_lengths).cumsum(0).tolist(), dtype=dtype)


CASES = [
    # (shape, dim, world, doc lengths or None)
    ((2, 24, 3), 1, 3, None),
    ((48,), 0, 4, None),
    ((3, 2, 16, 5), 2, 2, [4, 0, 8, 4]),  # an empty document
    ((40, 6), 0, 2, [8, 12, 20]),
    ((2, 16, 3), 1, 1, [6, 10]),
]


@pytest.mark.parametrize("shape,dim,world,docs", CASES)
def test_reference_matches_explicit_chunks(shape, dim, world, docs):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    lengths = docs if docs is not None else [shape[dim]]
    cu = None if docs is None else cu_of(docs)
    shards = []
    for rank in range(world):
        expected = explicit_shard(x, dim, rank, world, lengths)
        got = zigzag_gather_reference(x, dim, rank, world, cu)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(zigzag_gather(x, dim - x.dim(), rank, world, cu), expected, rtol=0, atol=0)
        shards.append(expected)
        # One rank's scatter: its rows in place, every other row zero.
        scattered = zigzag_scatter_reference(expected, dim, rank, world, cu)
        mask = zigzag_scatter_reference(torch.ones_like(expected), dim, rank, world, cu)
        torch.testing.assert_close(scattered, x * mask, rtol=0, atol=0)
    # All ranks: a permutation (the all-gather order) and its exact inverse.
    everything = zigzag_gather(x, dim, None, world, cu)
    torch.testing.assert_close(everything, torch.cat(shards, dim=dim), rtol=0, atol=0)
    torch.testing.assert_close(zigzag_scatter(everything, dim, None, world, cu), x, rtol=0, atol=0)
    # The shards cover every row exactly once.
    total = sum(zigzag_scatter_reference(torch.ones_like(s), dim, r, world, cu) for r, s in enumerate(shards))
    torch.testing.assert_close(total, torch.ones_like(x), rtol=0, atol=0)


def test_scatter_into_out_and_gradients():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    cu = cu_of([8, 24], torch.int64)
    shard = zigzag_gather(x, 1, 1, 2, cu)
    upstream = torch.randn(shard.shape, dtype=torch.float64, generator=gen)
    (shard * upstream).sum().backward()
    index_grad = torch.zeros_like(x)
    # Rank 1 of 2 holds chunks 1 and 2 of 4: rows 2..5 of document 0 (chunks of 2) and rows
    # 8+6 .. 8+17 of document 1 (chunks of 6).
    index_grad[:, [2, 3, 4, 5, *range(14, 26)]] = upstream
    torch.testing.assert_close(x.grad, index_grad, rtol=0, atol=0)

    y = torch.randn(3, 16, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    full = zigzag_scatter(y, 1, 0, 2, cu)
    (full * x.detach()).sum().backward()
    torch.testing.assert_close(y.grad, zigzag_gather_reference(x.detach(), 1, 0, 2, cu), rtol=0, atol=0)

    out = torch.full((3, 32, 4), float("nan"), dtype=torch.float64)
    zigzag_scatter(y.detach(), 1, 0, 2, cu, out=out)
    zigzag_scatter(zigzag_gather_reference(x.detach(), 1, 1, 2, cu), 1, 1, 2, cu, out=out)
    expected = zigzag_scatter_reference(y.detach(), 1, 0, 2, cu) + zigzag_scatter_reference(
        zigzag_gather_reference(x.detach(), 1, 1, 2, cu), 1, 1, 2, cu
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_bad_arguments_name_the_fix():
    x = torch.randn(2, 20)
    with pytest.raises(ValueError, match="not divisible by 2\\*world = 8"):
        zigzag_gather(x, 1, 0, 4)
    with pytest.raises(ValueError, match="document 1 has length 6"):
        zigzag_gather(x, 1, 0, 2, cu_of([4, 6, 10]))
    with pytest.raises(ValueError, match="run from 0 to the sequence length 20"):
        zigzag_gather(x, 1, 0, 2, cu_of([4, 8]))
    with pytest.raises(ValueError, match="rank must be"):
        zigzag_gather(x, 1, 2, 2)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        zigzag_gather(x, 2, 0, 2)


# ---------------------------------------------------------------------------------------------
# csrc kernel vs reference (GPU)
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # (shape, dim, world, docs, dtype): 16-byte rows, 6-byte rows, 1-byte rows, a misaligned view
    ((2, 4096, 8, 64), 1, 4, [1024, 0, 2048, 1024], torch.bfloat16),
    ((3, 96, 3), 1, 3, None, torch.float16),
    ((256, 5), 0, 8, [16, 64, 176], torch.uint8),
    ((4, 120), 1, 2, [40, 80], torch.float32),
    ((8192,), 0, 4, None, torch.int64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dim,world,docs,dtype", GPU_CASES)
@pytest.mark.parametrize("cu_on_gpu", [False, True])
def test_csrc_kernel_matches_reference(shape, dim, world, docs, dtype, cu_on_gpu):
    require_cuda_ext()
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.rand(shape, generator=gen, device="cuda") * 100).to(dtype)
    cu = None if docs is None else cu_of(docs).to("cuda" if cu_on_gpu else "cpu")
    for rank in [*range(world), None]:
        got = zigzag_gather(x, dim, rank, world, cu)
        torch.testing.assert_close(
            got, zigzag_gather_reference(x.cpu(), dim, rank, world, cu).cuda(), rtol=0, atol=0
        )
        out = torch.full_like(x, 77)  # poison: rows the scatter must not touch keep it
        zigzag_scatter(got, dim, rank, world, cu, out=out)
        expected = zigzag_scatter_reference(got.cpu(), dim, rank, world, cu, out=torch.full_like(x, 77).cpu())
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    # A misaligned start address forces the narrow-access path.
    flat = torch.randn(x.numel() + 1, device="cuda").to(dtype)
    shifted = flat[1:].view(shape)
    torch.testing.assert_close(
        zigzag_gather(shifted, dim, 0, world, cu),
        zigzag_gather_reference(shifted, dim, 0, world, cu),
        rtol=0,
        atol=0,
    )
