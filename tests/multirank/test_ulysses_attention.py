"""UlyssesAttention against float64 single-process attention (Ulysses sizes 2 and 4), the pack /
unpack transposes against a simulated all-to-all, the all-to-all count and bytes, head errors."""

import pytest
import torch
import torch.distributed as dist

from tests.support.cp_helpers import DOC_LENS, FULL_DOCS, SendCounter, local_inputs, rel_err, run_case
from xorl.nn.ulysses_attention import UlyssesAttention, kv_head_index
from xorl_kernels.ulysses.op import (
    ulysses_pack,
    ulysses_pack_reverse,
    ulysses_unpack,
    ulysses_unpack_reverse,
)

TOL = 1e-5
CASES = [
    ("causal packed padded GQA (KV replicated at U=4)", True, 1, "padded", DOC_LENS, 4, 2),
    ("causal batched MQA (KV replicated)", True, 2, "batched", 32, 4, 1),
    ("full packed MHA", False, 1, "packed", FULL_DOCS, 4, 4),
]


def _simulated_all_to_all(sends):
    """sends[src][dst] -> recvs[dst][src], as all_to_all_single does on dim 0."""
    world = len(sends)
    return [torch.stack([sends[src][dst] for src in range(world)]) for dst in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_pack_unpack_move_sequence_pieces_and_head_groups(world):
    """The layout contract the module relies on, through a simulated all-to-all."""
    g = torch.Generator().manual_seed(world)
    b, s, d, heads = 2, 3, 5, [2 * world, world, world]  # q, k, v heads (all ranks)
    pieces = [[torch.randn(b, s, h, d, generator=g) for h in heads] for _ in range(world)]  # per rank
    shapes = [tuple(t.shape) for t in pieces[0]]
    recvs = _simulated_all_to_all([ulysses_pack(p, world) for p in pieces])
    head_sharded = [ulysses_unpack(recvs[r], world, shapes) for r in range(world)]
    for rank in range(world):
        for i, h in enumerate(heads):
            hl = h // world
            full_seq = torch.cat([pieces[src][i] for src in range(world)], dim=1)
            assert torch.equal(head_sharded[rank][i], full_seq[:, :, rank * hl : (rank + 1) * hl])
    # And back: head-sharded full sequence -> sequence pieces with all heads.
    back_shapes = [tuple(t.shape) for t in head_sharded[0]]
    back = _simulated_all_to_all([ulysses_pack_reverse(t, world) for t in head_sharded])
    for rank in range(world):
        for got, want in zip(ulysses_unpack_reverse(back[rank], world, back_shapes), pieces[rank]):
            assert torch.equal(got, want)


def test_head_counts_that_cannot_work_name_the_sizes():
    assert kv_head_index(8, 4, 4) is None  # split
    assert kv_head_index(8, 2, 4).tolist() == [0, 0, 1, 1]  # replicated
    with pytest.raises(ValueError, match="num_attention_heads=6 must be divisible by the Ulysses size 4"):
        kv_head_index(6, 2, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3 and Ulysses size 2"):
        kv_head_index(6, 3, 2)


def _ulysses_errors(seed):
    group = dist.group.WORLD
    return [run_case(UlyssesAttention(group, _inner(case[1])), case, None, group, seed) for case in CASES]


def _inner(causal):
    from xorl.nn.ring_attention import RingAttention

    return RingAttention(None, causal=causal)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_float64_reference(gloo_world, world):
    per_rank = gloo_world(world).run(_ulysses_errors, world)
    for c, (name, *_) in enumerate(CASES):
        errs = [rel_err([r[c][t] for r in per_rank]) for t in range(4)]
        assert max(errs) < TOL, f"U={world} {name}: rel err out/dq/dk/dv = {errs}"


def _count_all_to_alls():
    group = dist.group.WORLD
    case = CASES[0]
    (q, k, v, do), _, _, cu, max_seqlen = local_inputs(case, None, group, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fwd, bwd = SendCounter(), SendCounter()
    with fwd.active():
        out = UlyssesAttention(group)(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen)
    with bwd.active():
        out.backward(do)
    return fwd.all_to_all, bwd.all_to_all, fwd.p2p_sends, tuple(q.shape), tuple(k.shape)


def test_ulysses_uses_two_all_to_alls_with_the_analytic_bytes(gloo_world):
    world = 4
    for fwd, bwd, p2p, (b, s, hq, d), (_, _, hkv, _) in gloo_world(world).run(_count_all_to_alls):
        kv_heads_per_rank = max(hkv // world, 1)  # 2 KV heads over 4 ranks: replicated, one each
        qkv = b * s * (hq + 2 * world * kv_heads_per_rank) * d * 4
        o = b * s * hq * d * 4
        leave = (world - 1) / world
        assert fwd == [(qkv, qkv * leave), (o, o * leave)]  # Q, K, V in ONE all-to-all, then the output
        assert bwd == [(o, o * leave), (qkv, qkv * leave)]
        assert p2p == []


# Sinks (each rank's inner attention takes its heads' slice), windows, head_dim_v != head_dim_qk.
FEATURE_CASES = [
    ("causal packed padded GQA, sinks, window 6, d_v 12", True, 1, "padded", DOC_LENS, 4, 2,
     {"sinks": True, "window": 6, "d_v": 12}),
    ("batched MQA (KV replicated), sinks, window 40, d_v 4", True, 2, "batched", 32, 4, 1,
     {"sinks": True, "window": 40, "d_v": 4}),
    ("full packed MHA, sinks, d_v 4", False, 1, "packed", FULL_DOCS, 4, 4, {"sinks": True, "d_v": 4}),
]  # fmt: skip


def _ulysses_feature_errors(seed):
    group = dist.group.WORLD
    return [run_case(UlyssesAttention(group, _inner(c[1])), c, None, group, seed) for c in FEATURE_CASES]


def test_ulysses_with_sinks_windows_and_narrow_v_matches_float64_reference(gloo_world):
    """U = 2: outputs and gradients of q, k, v and the sinks (summed over the ranks, as the
    gradient reduction over the CP ranks does) against one float64 process."""
    per_rank = gloo_world(2).run(_ulysses_feature_errors, 6)
    for c, (name, *_) in enumerate(FEATURE_CASES):
        assert len(per_rank[0][c]) == 5  # every case has sinks: their gradient is checked too
        errs = [rel_err([r[c][t] for r in per_rank]) for t in range(5)]
        assert max(errs) < TOL, f"U=2 {name}: rel err out/dq/dk/dv/dsinks = {errs}"


def _ulysses_narrow_v_bytes():
    group = dist.group.WORLD
    case = FEATURE_CASES[0]
    (q, k, v, do, sinks), *_, cu, max_seqlen = local_inputs(case, None, group, seed=5)
    counter = SendCounter()
    with counter.active():
        UlyssesAttention(group)(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, sinks=sinks, window=6)
    return counter.all_to_all, tuple(q.shape), tuple(k.shape), tuple(v.shape)


def test_ulysses_moves_v_with_its_own_width(gloo_world):
    for a2a, (b, s, hq, d), (_, _, hkv, _), (*_, d_v) in gloo_world(2).run(_ulysses_narrow_v_bytes):
        qkv = b * s * (hq * d + hkv * d + hkv * d_v) * 4
        o = b * s * hq * d_v * 4
        assert [total for total, _ in a2a] == [qkv, o]
