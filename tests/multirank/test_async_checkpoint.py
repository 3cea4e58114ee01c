"""Asynchronous checkpoints: training goes on while a save is written, the saved step is the one
that was staged, a crash mid-save keeps ``latest`` and the previous checkpoint; startup.json."""

from __future__ import annotations

import json
import os

import pytest
import torch

import xorl.checkpoint.state as ckpt
from tests.support.parity_runs import max_rel_diff, tiny_config, train_losses
from xorl.models.registry import build_model
from xorl.observability.metrics import read_metrics
from xorl.testing.multirank import GlooWorld, RankError

FSDP2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)


def test_a_background_save_holds_the_step_it_was_started_at(gloo_world, tmp_path):
    """Saved at step 2 while steps 3-4 train: resuming from step 2 logs the uninterrupted steps 3-4."""
    world = gloo_world(2)
    run = str(tmp_path / "run")
    full = world.run(train_losses, tiny_config(run, max_steps=4, save_steps=2, **FSDP2))[0]
    step2 = os.path.join(run, "checkpoints", "step_00000002")
    assert ckpt.latest_checkpoint(run).endswith("step_00000004")
    resumed = world.run(train_losses, tiny_config(str(tmp_path / "again"), max_steps=4, resume=step2, **FSDP2))[0]
    assert len(resumed) == 2 and max_rel_diff(resumed, full[2:]) <= 1e-6

    startup = json.load(open(os.path.join(run, "startup.json")))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(tiny_config(run).model).parameters())
    assert startup["model_parameters"] == parameters and startup["model_bytes"] == 4 * parameters
    assert [r["rank"] for r in startup["ranks"]] == [0, 1] and startup["world_size"] == 2
    for r in startup["ranks"]:
        assert r["peak_host_bytes"] > 100 * 2**20 and r["seconds"] > 0 and r["device_peak_bytes"] is None
    assert "seeded init" in startup["weights_from"]


_TRAINER = {}


def crash_while_saving_step_4(config) -> None:
    """Run to 6 steps saving every 2; the write of step 4 kills the process once step 5 has trained
    (so the save was in flight while training went on), before step 4 is complete."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    from xorl.trainer.trainer import Trainer

    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        if "step_00000004" in str(self.path):
            deadline = time.monotonic() + 300
            while _TRAINER["trainer"].step < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            with open(os.path.join(config.train.output_dir, "trained-while-saving"), "w") as f:
                f.write(str(_TRAINER["trainer"].step))
            os._exit(3)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_then_die
    _TRAINER["trainer"] = Trainer(config)
    _TRAINER["trainer"].train()


@pytest.mark.slow
def test_a_crash_mid_save_keeps_latest_and_the_previous_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    config = tiny_config(run, max_steps=6, save_steps=2)
    with GlooWorld(1, timeout_s=600) as world, pytest.raises(RankError, match="rank 0"):
        world.run(crash_while_saving_step_4, config)
    assert int(open(os.path.join(run, "trained-while-saving")).read()) >= 5
    root = os.path.join(run, "checkpoints")
    assert ckpt.latest_checkpoint(run) == os.path.join(root, "step_00000002")
    assert not os.path.exists(os.path.join(root, "step_00000004"))  # only its .tmp: never looks complete
    assert os.path.isfile(os.path.join(root, "step_00000002", ".metadata"))
    logged = [row["loss"] for row in read_metrics(os.path.join(run, "metrics.jsonl"))]  # one row per step
    with GlooWorld(1, timeout_s=600) as world:  # the previous checkpoint resumes to the same losses
        resumed = world.run(train_losses, tiny_config(run, max_steps=6, save_steps=2, resume=True))[0]
    assert len(resumed) == 4 and max_rel_diff(resumed[:2], logged[2:4]) <= 1e-6
