"""Trainer.close(): a process that builds one Trainer after another keeps no process group of the
earlier ones, counted as the harness counts (tests/multirank/test_multirank_harness.py): the gloo
threads alive (three per group) and the groups torch has registered."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # gloo worlds, real trainers

# One layout per Trainer, each making groups of its own kind: FSDP's mesh and its flattened views,
# TP's, and the pipeline's pairs and schedule.
LAYOUTS = [dict(data_parallel_shard_size=2), dict(tensor_parallel_size=2, data_parallel_shard_size=1),
           dict(pipeline_parallel_size=2, data_parallel_shard_size=1)]


def _groups_alive() -> tuple[int, int]:
    from xorl.testing.group_cleanup import live_groups, settle_gloo_threads

    return settle_gloo_threads(), len(live_groups())


def _trainers_one_after_another(output_dir: str) -> list[tuple[int, int]]:
    """(gloo threads, groups) before any Trainer, then with each trained and after its close(); each
    closed Trainer stays referenced, as a user's variable would keep it."""
    from tests.support.parity_runs import tiny_config
    from xorl.trainer.trainer import Trainer

    counts, closed = [_groups_alive()], []
    for i, layout in enumerate(LAYOUTS):
        trainer = Trainer(tiny_config(f"{output_dir}/{i}", "llama", max_steps=1, **layout))
        trainer.train()
        counts.append(_groups_alive())
        trainer.close()
        trainer.close()  # closing again does nothing
        counts.append(_groups_alive())
        closed.append(trainer)
    with pytest.raises(RuntimeError, match="this Trainer is closed"):
        closed[0].train()
    return counts


def test_closed_trainers_leave_no_process_groups_behind(gloo_world, tmp_path):
    world = gloo_world(2)
    starts = world.starts
    per_rank = world.run(_trainers_one_after_another, str(tmp_path), timeout_s=400)
    assert world.starts == starts  # the harness found nothing left to clean (a leak restarts the world)
    for counts in per_rank:
        before, trained, after = counts[0], counts[1::2], counts[2::2]
        # Each Trainer really made groups (so this can fail) ...
        assert all(threads >= before[0] + 15 and groups >= before[1] + 5 for threads, groups in trained), counts
        # ... and after its close() only what was there before it is left.
        assert after == [before] * len(LAYOUTS), counts


def _closed_by_a_with_block(output_dir: str) -> tuple[tuple[int, int], tuple[int, int], bool]:
    import torch.distributed as dist

    from tests.support.parity_runs import tiny_config
    from xorl.trainer.trainer import Trainer

    before = _groups_alive()
    with Trainer(tiny_config(output_dir, "llama", max_steps=1, data_parallel_shard_size=2)) as trainer:
        trainer.train()
        during = _groups_alive()
    return before, during, _groups_alive() == before and dist.is_initialized()


def test_a_with_block_closes_the_trainer_and_keeps_the_default_group_it_did_not_start(gloo_world, tmp_path):
    """The harness started the default group, so the Trainer leaves it (a world of one that the Trainer
    started: tests/unit/trainer/test_trainer_close.py)."""
    for before, during, closed in gloo_world(2).run(_closed_by_a_with_block, str(tmp_path)):
        assert during[1] > before[1] and closed, (before, during)
