"""bench/bench_step_anatomy.py: its counter is exact on a hand-made case, and one training step of a
TP layout and of an EP layout meets its targets (exact counts, any device): each TP rank computes 1/TP
of the matmuls and of the lm_head, one host read and one replicated-gradient all-reduce a step, and EP
dispatch sends no more than the deduplicated rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.anatomy_comm import CommCounter
from bench.bench_step_anatomy import layout_results, make_layout, measure_layout


def _known_collectives() -> list[tuple[str, int, bool]]:
    """Four collectives whose bytes are known by hand, on 2 ranks."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    rank = dist.get_rank()
    x = torch.randn(5, 3)  # 12 bytes a row
    send = [2, 3] if rank == 0 else [1, 4]  # rank 0 sends 3 rows away, rank 1 sends 1
    recv = [2, 1] if rank == 0 else [3, 4]
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(10))  # 40 bytes
        gathered = torch.empty(12)
        dist.all_gather_into_tensor(gathered, torch.ones(6))  # this rank's 24 bytes
        out = x.new_empty(sum(recv), 3)
        dist.all_to_all_single(out, x, recv, send)
        wait_tensor(all_to_all_single_autograd(x, recv, send, dist.group.WORLD))
    return [(e.kind, e.nbytes, e.functional) for e in counter.events]


def test_the_counter_sees_each_collective_once_with_the_bytes_this_rank_sends(gloo_world):
    got = gloo_world(2).run(_known_collectives)
    for rank, away in ((0, 36), (1, 12)):
        assert got[rank] == [("all_reduce", 40, False), ("all_gather", 24, False), ("all_to_all", away, False),
                             ("all_to_all", away, True)], (rank, got[rank])


def _rows(name: str, data: dict) -> dict:
    return {r.name.split(": ", 1)[1]: r for r in layout_results(name, data)}


def test_tensor_parallel_step_computes_a_tp_share_of_the_head_and_sums_replicated_grads_once(gloo_world, tmp_path):
    layout = make_layout("tp2+sp", "llama", tensor_parallel_size=2, sequence_parallel=True)
    rows = _rows(layout.name, measure_layout(layout, str(tmp_path), gloo_world))
    head = rows["lm_head FLOPs per TP rank"]
    assert head.value > 0 and head.value == head.anchor_value  # exactly 1/TP of one process's
    assert rows["replicated-gradient all-reduces over TP per step"].value == 1
    assert rows["host reads per step"].value == 1
    # Every rank computes 1/TP of the matmuls the single process computes.
    flops = rows["matmul FLOPs per rank (max)"]
    assert flops.value == flops.anchor_value, flops.params["per_rank_over_ideal"]


def test_expert_parallel_dispatch_sends_the_deduplicated_minimum(gloo_world, tmp_path):
    layout = make_layout("fsdp2 ep2", "qwen3_moe", data_parallel_shard_size=2, expert_parallel_size=2)
    data = measure_layout(layout, str(tmp_path), gloo_world)
    rows = _rows(layout.name, data)
    dispatch = rows["EP dispatch bytes (all ranks)"]
    assert dispatch.anchor_value > 0 and dispatch.value <= 1.05 * dispatch.anchor_value
    # Top-2 of 8 experts on 2 ranks: some tokens pick two experts of one rank, so one row per
    # routing slot would send more than the minimum; the test could tell them apart.
    assert dispatch.params["topk_rows_bytes"] > dispatch.anchor_value
    metadata = rows["EP dispatch metadata bytes (all ranks)"]
    assert metadata.value == metadata.anchor_value > 0
    # One read at the end of the step and one per MoE layer per microbatch (the split sizes).
    reads = rows["host reads per step"]
    assert reads.value == reads.anchor_value == 1 + data["ranks"][0]["layers"] * data["ranks"][0]["microbatches"]
