"""Ulysses pack/unpack: a simulated all-to-all against direct slicing, csrc kernels against references."""

from __future__ import annotations

import pytest
import torch

from tests.support.csrc_helpers import require_cuda_ext
from xorl_kernels.ulysses.op import ulysses_pack, ulysses_pack_reverse, ulysses_unpack, ulysses_unpack_reverse
from xorl_kernels.ulysses.reference import (
    ulysses_pack_reference,
    ulysses_pack_reverse_reference,
    ulysses_unpack_reference,
    ulysses_unpack_reverse_reference,
)


def all_to_all(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """What all_to_all_single does to P [P, D] buffers: rank r receives row r of every rank's buffer."""
    return [torch.stack([buf[r] for buf in buffers]) for r in range(len(buffers))]


def qkv(gen, batch, seq, heads, kv_heads, head_dim, v_dim, dtype=torch.float32, device="cpu"):
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, v_dim)]
    return [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_round_trip_through_simulated_all_to_all(world):
    gen = torch.Generator().manual_seed(world)
    full = qkv(gen, 2, 8 * world, 2 * world, world, 3, 5)  # GQA heads, a different V head dim
    seq_local = full[0].shape[1] // world
    chunks = [[t[:, r * seq_local : (r + 1) * seq_local].contiguous() for t in full] for r in range(world)]

    # Forward direction: every rank gets the whole sequence of its head group.
    recv = all_to_all([ulysses_pack(c, world) for c in chunks])
    head_sharded = []
    for r in range(world):
        ys = ulysses_unpack(recv[r], world, [tuple(t.shape) for t in chunks[r]])
        for y, t in zip(ys, full):
            h = t.shape[2] // world
            torch.testing.assert_close(y, t[:, :, r * h : (r + 1) * h], rtol=0, atol=0)
        head_sharded.append(ys)

    # Reverse direction gives every rank its sequence chunk of all heads back.
    recv = all_to_all([ulysses_pack_reverse(ys, world) for ys in head_sharded])
    for r in range(world):
        xs = ulysses_unpack_reverse(recv[r], world, [tuple(y.shape) for y in head_sharded[r]])
        for x, t in zip(xs, chunks[r]):
            torch.testing.assert_close(x, t, rtol=0, atol=0)


def test_buffer_rows_are_the_documented_pieces():
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 3, 2, 6, generator=gen)
    buf = ulysses_pack([q, k], 2)
    for p in range(2):
        expected = torch.cat([q[:, :, 2 * p : 2 * p + 2].flatten(), k[:, :, p].flatten()])
        torch.testing.assert_close(buf[p], expected, rtol=0, atol=0)
    y = torch.randn(2, 6, 3, 4, generator=gen)
    buf = ulysses_pack_reverse([y], 3)
    for p in range(3):
        torch.testing.assert_close(buf[p], y[:, 2 * p : 2 * p + 2].flatten(), rtol=0, atol=0)


def test_bad_shapes_name_the_fix():
    q = torch.randn(1, 4, 3, 2)
    with pytest.raises(ValueError, match="number of heads 3, not divisible by world=2"):
        ulysses_pack([q], 2)
    with pytest.raises(ValueError, match="sequence length 4, not divisible by world=3"):
        ulysses_pack_reverse([q], 3)
    with pytest.raises(ValueError, match="pass the shapes every rank packed"):
        ulysses_unpack(torch.randn(2, 10), 2, [(1, 4, 2, 2)])
    with pytest.raises(ValueError, match="must match tensors\\[0\\]"):
        ulysses_pack([torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2).double()], 2)


# ---------------------------------------------------------------------------------------------
# csrc kernels vs references (GPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,v_dim",
    [(torch.bfloat16, 32, 8, 128, 128), (torch.float32, 8, 8, 64, 32), (torch.float16, 12, 4, 3, 5)],
)
@pytest.mark.parametrize("world", [2, 4])
def test_csrc_kernels_match_references(dtype, heads, kv_heads, head_dim, v_dim, world):
    from xorl_kernels.ulysses.csrc import (
        ext_ulysses_pack,
        ext_ulysses_pack_reverse,
        ext_ulysses_unpack,
        ext_ulysses_unpack_reverse,
    )

    require_cuda_ext()
    gen = torch.Generator(device="cuda").manual_seed(11)
    xs = qkv(gen, 2, 64, heads, kv_heads, head_dim, v_dim, dtype, "cuda")
    shapes = [tuple(t.shape) for t in xs]
    buf = torch.full_like(ulysses_pack_reference(xs, world), float("nan"))  # poison
    ext_ulysses_pack(xs, world, out=buf)
    torch.testing.assert_close(buf, ulysses_pack_reference(xs, world), rtol=0, atol=0)

    recv = torch.randn(buf.shape, generator=gen, device="cuda").to(dtype)
    for got, ref in zip(
        ext_ulysses_unpack(recv, world, shapes), ulysses_unpack_reference(recv, world, shapes)
    ):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)

    ys = qkv(gen, 2, 64 * world, heads // world, kv_heads // world, head_dim, v_dim, dtype, "cuda")
    rshapes = [tuple(t.shape) for t in ys]
    torch.testing.assert_close(
        ext_ulysses_pack_reverse(ys, world), ulysses_pack_reverse_reference(ys, world), rtol=0, atol=0
    )
    recv = torch.randn(ulysses_pack_reverse_reference(ys, world).shape, generator=gen, device="cuda").to(
        dtype
    )
    outs = ext_ulysses_unpack_reverse(recv, world, rshapes)
    for got, ref in zip(outs, ulysses_unpack_reverse_reference(recv, world, rshapes)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_csrc_unpack_rows_of_megabytes():
    """Llama-3-8B-like Ulysses 8 (4096 tokens per rank, 32 / 8 / 8 heads, bf16): after the all-to-all
    24 rows of up to 4 MB, cut into more (row, chunk) items than the grid has lane groups, so the
    grid-stride loop runs; both directions, exact against the references."""
    from xorl_kernels.ulysses.csrc import ext_ulysses_pack_reverse, ext_ulysses_unpack

    require_cuda_ext()
    world, gen = 8, torch.Generator(device="cuda").manual_seed(13)
    shapes = [(1, 4096, h, 128) for h in (32, 8, 8)]
    recv = torch.randn(world, sum(s[1] * s[2] * s[3] for s in shapes) // world, generator=gen, device="cuda")
    recv = recv.to(torch.bfloat16)
    outs = [torch.full((1, world * s[1], s[2] // world, s[3]), float("nan"), dtype=torch.bfloat16, device="cuda")
            for s in shapes]
    ext_ulysses_unpack(recv, world, shapes, outs=outs)
    for got, ref in zip(outs, ulysses_unpack_reference(recv, world, shapes)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    buf = torch.full_like(recv, float("nan"))
    ext_ulysses_pack_reverse(outs, world, out=buf)
    torch.testing.assert_close(buf, ulysses_pack_reverse_reference(outs, world), rtol=0, atol=0)
