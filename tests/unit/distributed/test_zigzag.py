"""Zig-zag layout, shard/unshard round trips, and the shift + pad + shard batch helper."""

import pytest
import torch
import torch.distributed as dist

from tests.support.cp_helpers import cp_groups
from xorl.distributed.zigzag import (
    padded_document_lengths,
    prepare_context_parallel_batch,
    zigzag_local_indices,
    zigzag_shard,
    zigzag_unshard,
    zigzag_unshard_from_shards,
)
from xorl_kernels.zigzag.layout import zigzag_positions

DOCS = [0, 8, 24, 32]  # three documents of 8, 16, 8 tokens: divisible by 2P for P <= 4


def test_layout_is_chunks_r_and_2p_minus_1_minus_r_of_every_document():
    # Written out by hand for 2 ring ranks: 4 chunks per document.
    assert zigzag_local_indices(16, None, (0, 2)).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_local_indices(16, None, (1, 2)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_local_indices(16, [0, 8, 16], (1, 2)).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    # Ulysses splits the ring-local sequence contiguously.
    assert zigzag_local_indices(16, None, (0, 2), (1, 2)).tolist() == [12, 13, 14, 15]


@pytest.mark.parametrize("ring,ulysses", [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (4, 2)])
def test_shards_partition_the_sequence_and_unshard_restores_it(ring, ulysses):
    g = torch.Generator().manual_seed(ring * 10 + ulysses)
    x = torch.randn(2, 32, 3, generator=g)
    labels = torch.randint(0, 100, (2, 32), generator=g)
    shards, label_shards = [], []
    for flat in range(ring * ulysses):
        r, u = divmod(flat, ulysses)
        xs, ls = zigzag_shard([x, labels], 1, (r, ring), DOCS, ulysses=(u, ulysses))
        assert xs.shape == (2, 32 // (ring * ulysses), 3)
        shards.append(xs)
        label_shards.append(ls)
    all_idx = torch.cat(
        [zigzag_local_indices(32, DOCS, (f // ulysses, ring), (f % ulysses, ulysses)) for f in range(ring * ulysses)]
    )
    assert sorted(all_idx.tolist()) == list(range(32))
    assert torch.equal(zigzag_unshard_from_shards(shards, 1, ring, DOCS, ulysses), x)
    assert torch.equal(zigzag_unshard_from_shards(label_shards, 1, ring, DOCS, ulysses), labels)


@pytest.mark.parametrize("ring", [1, 2, 4])
def test_device_positions_match_within_document_positions(ring):
    cu = torch.tensor(DOCS)
    within_doc = torch.arange(32) - cu[torch.searchsorted(cu[1:], torch.arange(32), right=True)]
    every_rank = zigzag_positions(32, None, ring, cu, within_document=True).view(ring, -1)
    for r in range(ring):
        local = zigzag_local_indices(32, DOCS, (r, ring))
        expected = within_doc[local]
        assert torch.equal(every_rank[r], expected)
        assert torch.equal(zigzag_positions(32, r, ring, cu, within_document=True), expected)
        assert torch.equal(zigzag_positions(32, r, ring, cu), local)  # rows of the full sequence


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="not divisible by 2 × ring size = 4"):
        zigzag_local_indices(16, [0, 6, 16], (0, 2))
    with pytest.raises(ValueError, match="start at 0 and end at the sequence length"):
        zigzag_local_indices(16, [0, 8, 12], (0, 2))
    with pytest.raises(ValueError, match="rank=2, size=2"):
        zigzag_shard(torch.zeros(1, 16), 1, (2, 2))
    with pytest.raises(ValueError, match="same length along dim=1"):
        zigzag_shard([torch.zeros(1, 16), torch.zeros(1, 8)], 1, (0, 2))


def test_padded_lengths_per_document_then_total():
    assert padded_document_lengths([13, 30, 5], 2) == [16, 32, 8]
    assert padded_document_lengths([13, 30, 5], 2, 2) == [16, 32, 8]  # total 56 divides by 8
    assert padded_document_lengths([13, 30, 6], 4, 2) == [16, 32, 16]  # 64 divides by 16
    assert padded_document_lengths([13, 30, 6], 1, 4) == [13, 30, 9]  # ring 1: only the total
    assert padded_document_lengths([13, 30, 5], 8) == [16, 32, 16]


@pytest.mark.parametrize("ring,ulysses", [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_prepare_batch_shifts_before_sharding_and_pads_without_truncating(ring, ulysses):
    doc_lens = [13, 30, 5]
    cu = [0, 13, 43, 48]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 1000, (1, 48), generator=g)
    pos = torch.cat([torch.arange(n) for n in doc_lens])[None] + 3  # arbitrary given positions
    parts = [
        prepare_context_parallel_batch(
            ids,
            position_ids=pos,
            cu_seqlens=cu,
            ring=(f // ulysses, ring),
            ulysses=(f % ulysses, ulysses),
            pad_token_id=0,
        )
        for f in range(ring * ulysses)
    ]
    new_cu = parts[0].cu_seqlens
    padded = (new_cu[1:] - new_cu[:-1]).tolist()
    assert padded == padded_document_lengths(doc_lens, ring, ulysses)
    assert parts[0].max_seqlen == max(padded) and parts[0].num_pad_tokens == sum(padded) - 48
    full_ids, full_labels, full_pos = (
        zigzag_unshard_from_shards([getattr(p, name) for p in parts], 1, ring, new_cu, ulysses)
        for name in ("input_ids", "labels", "position_ids")
    )
    for d, n in enumerate(doc_lens):
        s, p = int(new_cu[d]), padded[d]
        real = ids[0, cu[d] : cu[d] + n]
        assert torch.equal(full_ids[0, s : s + n], real)  # every real token kept, in order
        assert torch.equal(full_labels[0, s : s + n - 1], real[1:])  # target = next token of the same doc
        assert (full_labels[0, s + n - 1 : s + p] == -100).all()  # doc end and padding ignored
        assert (full_ids[0, s + n : s + p] == 0).all()
        assert torch.equal(full_pos[0, s : s + p], torch.arange(p) + 3)  # positions continue into padding


def test_prepare_batch_without_documents_pads_the_end():
    ids = torch.arange(1, 12)[None]  # 11 tokens, ring 2 -> padded to 12
    parts = [prepare_context_parallel_batch(ids, ring=(r, 2)) for r in range(2)]
    assert parts[0].cu_seqlens.tolist() == [0, 12]
    labels = zigzag_unshard_from_shards([p.labels for p in parts], 1, 2, parts[0].cu_seqlens)
    assert labels[0].tolist() == list(range(2, 12)) + [-100, -100]


def _unshard_over_groups():
    ring_group, ulysses_group = cp_groups(2, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 32, 4, generator=g)
    local = zigzag_shard(x, 1, ring_group, DOCS, ulysses=ulysses_group)
    expected = zigzag_local_indices(32, DOCS, (dist.get_rank(ring_group), 2), (dist.get_rank(ulysses_group), 2))
    assert torch.equal(local, x[:, expected])
    return torch.equal(zigzag_unshard(local, 1, ring_group, DOCS, ulysses=ulysses_group), x)


def test_unshard_gathers_over_ring_and_ulysses_groups(gloo_world):
    assert gloo_world(4).run(_unshard_over_groups) == [True] * 4
