"""The multi-rank harness itself: results come back per rank, errors and hangs fail with a message."""

import time

import pytest
import torch
import torch.distributed as dist

from xorl.testing.multirank import GlooWorld, RankError


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("planted failure")
    return dist.get_rank()


def _hang_on_rank_zero() -> None:
    # Rank 0 waits on a collective that rank 1 never joins.
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(0.1)


def test_results_come_back_per_rank(gloo_world):
    world = gloo_world(4)
    assert world.run(_all_reduce_rank) == [10.0] * 4


def test_error_on_one_rank_names_it_and_world_recovers():
    with GlooWorld(2, timeout_s=60) as world:
        with pytest.raises(RankError, match="planted failure") as info:
            world.run(_fail_on_rank_one)
        assert "ranks [1]" in str(info.value)
        assert world.run(_all_reduce_rank) == [3.0, 3.0]  # restarted transparently


def test_hang_becomes_timeout_error():
    with GlooWorld(2, timeout_s=60) as world:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
            world.run(_hang_on_rank_zero, timeout_s=5)
        assert time.monotonic() - start < 30
