"""Routing metadata and the row moves: references against Python loops, csrc kernels against references."""

from __future__ import annotations

import pytest
import torch

from tests.support.csrc_helpers import require_cuda_ext
from xorl_kernels.moe_permute.reference import permute_rows_reference, unpermute_combine_reference
from xorl_kernels.moe_permute.routing import routing_metadata, routing_metadata_reference


def loop_metadata(expert_ids: torch.Tensor, num_experts: int):
    """The definitions, one slot at a time: experts in order, slots in order inside each, dropped last."""
    ids = expert_ids.reshape(-1).tolist()
    top_k = expert_ids.shape[1]
    order = [s for e in range(num_experts) for s, i in enumerate(ids) if i == e]
    counts = [sum(1 for i in ids if i == e) for e in range(num_experts)]
    order += [s for s, i in enumerate(ids) if not 0 <= i < num_experts]
    row_map = [0] * len(ids)
    for row, s in enumerate(order):
        row_map[s] = row
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return order, row_map, counts, offsets, [s // top_k for s in order]


def random_ids(tokens, top_k, num_experts, gen, used=None, dropped=0.0):
    """Distinct experts per token as a router picks them (repeats when top_k exceeds the experts used);
    `used` limits the experts that appear."""
    pool = num_experts if used is None else used
    if top_k > pool:
        ids = torch.randint(0, pool, (tokens, top_k), generator=gen)
    else:
        ids = torch.rand(tokens, pool, generator=gen).argsort(dim=1)[:, :top_k]
    if dropped:
        ids[torch.rand(tokens, top_k, generator=gen) < dropped] = -1
    return ids


CASES = [
    # (tokens, top_k, num_experts, used experts, dropped fraction)
    (37, 2, 8, None, 0.0),
    (50, 4, 16, 5, 0.0),  # 11 empty experts
    (20, 1, 6, 1, 0.0),  # one expert takes every token
    (25, 4, 3, None, 0.0),  # repeated experts within a token
    (30, 3, 7, None, 0.2),  # dropped slots (-1)
    (0, 2, 4, None, 0.0),  # no tokens
]


@pytest.mark.parametrize("tokens,top_k,num_experts,used,dropped", CASES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reference_matches_loop(tokens, top_k, num_experts, used, dropped, dtype):
    gen = torch.Generator().manual_seed(tokens * 31 + top_k)
    ids = random_ids(tokens, top_k, num_experts, gen, used, dropped).to(dtype)
    order, row_map, counts, offsets, sorted_tokens = loop_metadata(ids, num_experts)
    meta = routing_metadata_reference(ids, num_experts)
    assert meta.sorted_slots.tolist() == order
    assert meta.row_map.reshape(-1).tolist() == row_map and meta.row_map.shape == ids.shape
    assert meta.tokens_per_expert.tolist() == counts
    assert meta.expert_offsets.tolist() == offsets
    assert meta.sorted_tokens.tolist() == sorted_tokens
    assert all(t.dtype == torch.int64 for t in meta)
    dispatched = routing_metadata(ids, num_experts)
    assert all(torch.equal(a, b) for a, b in zip(dispatched, meta))


def test_ids_beyond_num_experts_are_an_error():
    with pytest.raises(ValueError, match="must be < num_experts=4"):
        routing_metadata(torch.tensor([[0, 4]]), 4)
    with pytest.raises(TypeError, match="int32 or int64"):
        routing_metadata(torch.tensor([[0.0, 1.0]]), 4)


def test_row_move_references_match_loops():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5, generator=gen)
    src = torch.tensor([3, 0, 8, -1, 9, 3, 2])  # -1 and 9 are outside [0, 9): zero rows
    got = permute_rows_reference(x, src)
    for r, i in enumerate(src.tolist()):
        expected = x[i] if 0 <= i < 9 else torch.zeros(5)
        assert torch.equal(got[r], expected)

    for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]:
        y = torch.randn(12, 7, generator=gen).to(dtype)
        rows = torch.randint(0, 12, (6, 3), generator=gen)
        rows[2, 1] = -1  # a dropped slot adds nothing
        w = torch.rand(6, 3, generator=gen)
        out = unpermute_combine_reference(y, rows, w)
        assert out.dtype == dtype
        expected = torch.zeros(6, 7, dtype=torch.float64)
        for t in range(6):
            for k in range(3):
                if rows[t, k] >= 0:
                    expected[t] += float(w[t, k]) * y[rows[t, k]].double()
        err = (out.double() - expected).norm() / expected.norm()
        assert err < tol, f"{dtype}: relative error {err}"


# ---------------------------------------------------------------------------------------------
# csrc kernels vs references (GPU)
# ---------------------------------------------------------------------------------------------

GPU_ROUTING = [
    (4096, 8, 64, None, 0.0),  # many tiles
    (70000, 2, 8, None, 0.0),  # > kTargetTiles * kMinTile slots: larger tiles
    (3000, 3, 256, 3, 0.0),  # mostly empty experts
    (2048, 1, 1, None, 0.0),  # one expert
    (513, 1, 32, 1, 0.0),  # every slot on expert 0
    (5000, 8, 3, None, 0.0),  # repeated experts: whole warps share a bucket
    (1000, 6, 4096, None, 0.1),  # the largest expert count, with dropped slots
    (0, 4, 16, None, 0.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,num_experts,used,dropped", GPU_ROUTING)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_csrc_routing_matches_reference(tokens, top_k, num_experts, used, dropped, dtype):
    from xorl_kernels.moe_permute.csrc import ext_routing_metadata

    require_cuda_ext()
    gen = torch.Generator().manual_seed(tokens + num_experts)
    ids = random_ids(tokens, top_k, num_experts, gen, used, dropped).to(dtype)
    expected = routing_metadata_reference(ids, num_experts)
    got = ext_routing_metadata(ids.cuda(), num_experts)
    for name, a, b in zip(expected._fields, got, expected):
        assert torch.equal(a.cpu(), b), f"{name} differs"
    again = ext_routing_metadata(ids.cuda(), num_experts)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("hidden", [1024, 1001, 3])  # 16-byte rows, odd rows, tiny rows
def test_csrc_permute_rows_matches_reference(dtype, hidden):
    from xorl_kernels.moe_permute.csrc import ext_permute_rows

    require_cuda_ext()
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(300, hidden, generator=gen, device="cuda") * 50).to(dtype)
    src = torch.randint(-2, 302, (700,), generator=gen, device="cuda")  # a few out of range: zero rows
    out = torch.full((700, hidden), 7, dtype=dtype, device="cuda")  # poison
    ext_permute_rows(x, src, out=out)
    torch.testing.assert_close(out, permute_rows_reference(x, src), rtol=0, atol=0)
    shifted = torch.randn(300 * hidden + 1, device="cuda").to(dtype)[1:].view(300, hidden)  # misaligned
    torch.testing.assert_close(
        ext_permute_rows(shifted, src), permute_rows_reference(shifted, src), rtol=0, atol=0
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("hidden", [2048, 33])
def test_csrc_unpermute_combine_matches_reference(dtype, tol, hidden):
    from xorl_kernels.moe_permute.csrc import ext_unpermute_combine

    require_cuda_ext()
    gen = torch.Generator(device="cuda").manual_seed(5)
    tokens, top_k = 513, 6
    y = torch.randn(tokens * top_k, hidden, generator=gen, device="cuda").to(dtype)
    rows = torch.randperm(tokens * top_k, generator=gen, device="cuda").view(tokens, top_k)
    rows[::7, 2] = -1  # dropped slots
    w = torch.rand(tokens, top_k, generator=gen, device="cuda")
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device="cuda")  # poison
    ext_unpermute_combine(y, rows, w, out=out)
    valid = rows >= 0
    gathered = y.double()[rows.clamp(min=0)] * (w.double() * valid).unsqueeze(-1)
    expected = gathered.sum(1)
    err = (out.double() - expected).norm() / expected.norm()
    assert err < tol, f"relative error {err}"
    torch.testing.assert_close(out, unpermute_combine_reference(y, rows, w), rtol=2 * tol, atol=2 * tol)
    assert torch.equal(out, ext_unpermute_combine(y, rows, w)), "not deterministic"
