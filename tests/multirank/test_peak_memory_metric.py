"""The logged ``peak_memory_gib`` is the busiest rank's, not rank 0's (StepPlan.after_backward carries
every rank's peak on the step's sums): on 2 gloo ranks, rank 1 alone first holds 512 MiB more."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow  # a gloo world, a real trainer

BALLAST_BYTES = 512 * 2**20


def _train_with_a_heavier_rank_one(output_dir: str) -> dict | None:
    """Rank 1 touches (and frees) BALLAST_BYTES before training; each rank's host peak, before and
    after the step, and rank 0's logged figure."""
    import torch
    import torch.distributed as dist

    from tests.support.parity_runs import tiny_config
    from xorl.observability.memory_report import peak_host_bytes, reset_peak_host_bytes
    from xorl.trainer.trainer import Trainer

    if not reset_peak_host_bytes():  # the high-water mark restarts at what each rank holds now
        return None  # the OS cannot (no /proc/self/clear_refs)
    try:
        if dist.get_rank() == 1:
            ballast = torch.ones(BALLAST_BYTES // 4)  # written, so resident
            del ballast
        with Trainer(tiny_config(output_dir, "llama", max_steps=1, data_parallel_shard_size=2)) as trainer:
            before = peak_host_bytes()
            trainer.train()
            after = peak_host_bytes()
        logged = None
        if dist.get_rank() == 0:
            with open(os.path.join(output_dir, "metrics.jsonl")) as f:
                logged = json.loads(f.readline())["peak_memory_gib"] * 2**30
        return {"before": before, "after": after, "logged": logged}
    finally:
        reset_peak_host_bytes()  # later checks on this rank measure their own peaks


def test_the_logged_peak_memory_is_the_busiest_rank_s(gloo_world, tmp_path):
    rank0, rank1 = gloo_world(2).run(_train_with_a_heavier_rank_one, str(tmp_path))
    if rank0 is None or rank1 is None:
        pytest.skip("the OS cannot restart the peak resident memory (/proc/self/clear_refs)")
    logged = rank0["logged"]
    assert rank1["before"] > rank0["after"] + BALLAST_BYTES / 2  # the ranks really differ
    # Rank 1's peak (its ballast in it), never more than any rank reached by the end of the step.
    assert rank1["before"] <= logged <= max(rank0["after"], rank1["after"])
    assert logged > rank0["after"]  # not rank 0's own figure
