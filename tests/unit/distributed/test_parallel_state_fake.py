"""ParallelState on big worlds (up to 64 ranks) in one process, with torch's fake process group.

The fake backend lets one process play any rank of any world size: each sampled rank initialises
the default group as that rank, builds the state, reports its coordinates, groups and meshes, and
destroys the group again. It runs in a subprocess so the test process keeps no default group.
Groups are compared with rank arithmetic done independently (tests/support/parallel_layouts.py);
collectives are not checked here (the fake backend moves no data; the gloo tests do that).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.support.parallel_layouts import compare, expected_state
from tests.support.paths import REPO_ROOT

REPO_ROOT = REPO_ROOT

LAYOUTS = [
    (8, {}),  # FSDP only
    (8, {"ringattn_parallel_size": 4}),  # FSDP 2 x ring 4
    (16, {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}),  # FSDP 8 x PP 2
    # PP 2 x EP 4 folded over CP 4 (ring 2 x ulysses 2)
    (8, {"pipeline_parallel_size": 2, "ringattn_parallel_size": 2, "ulysses_parallel_size": 2,
         "expert_parallel_size": 4, "gradient_accumulation_steps": 2}),
    # PP 4 x HSDP (2 replicas x 4 shards)
    (32, {"pipeline_parallel_size": 4, "data_parallel_replicate_size": 2, "gradient_accumulation_steps": 4}),
    (64, {"ulysses_parallel_size": 64, "expert_parallel_size": 64}),  # EP 64 over Ulysses 64
    # every dim 2, EP 4 folded over dp_shard 2 x ring 2 x ulysses 2
    (64, {"pipeline_parallel_size": 2, "data_parallel_replicate_size": 2, "data_parallel_shard_size": 2,
          "ringattn_parallel_size": 2, "ulysses_parallel_size": 2, "tensor_parallel_size": 2,
          "expert_parallel_size": 4, "gradient_accumulation_steps": 2}),
    (16, {"tensor_parallel_size": 4, "ulysses_parallel_size": 4, "expert_parallel_size": 2}),
]


def sampled_ranks(world_size: int) -> list[int]:
    if world_size <= 16:
        return list(range(world_size))
    rng = random.Random(world_size)
    picks = {0, 1, world_size // 2 - 1, world_size // 2, world_size - 2, world_size - 1}
    picks.update(rng.sample(range(world_size), 2))
    return sorted(picks)


def _probe_main() -> None:
    """Subprocess entry: JSON [[world, layout, ranks], ...] on stdin -> observations on stdout."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.support.parallel_layouts import observe_state
    from xorl.distributed import ParallelConfig, init_parallel_state

    results = []
    for world_size, layout, ranks in json.load(sys.stdin):
        for rank in ranks:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                state = init_parallel_state(ParallelConfig(**layout))
                results.append(observe_state(state, collectives=False))
            finally:
                dist.destroy_process_group()
    json.dump(results, sys.stdout)


@pytest.fixture(scope="module")
def observations():
    jobs = [[world, layout, sampled_ranks(world)] for world, layout in LAYOUTS]
    proc = subprocess.run(
        [sys.executable, "-c",
         "from tests.unit.distributed.test_parallel_state_fake import _probe_main; _probe_main()"],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = iter(json.loads(proc.stdout))
    return {(i, rank): next(results) for i, (_, _, ranks) in enumerate(jobs) for rank in ranks}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{w}ranks-{i}" for i, (w, _) in enumerate(LAYOUTS)])
def test_big_layouts_match_rank_arithmetic(observations, index):
    world_size, layout = LAYOUTS[index]
    for rank in sampled_ranks(world_size):
        compare(observations[(index, rank)], expected_state(rank, world_size, layout), f"rank {rank}: {layout}")
