"""Trainer.close() in a world of one that the Trainer started itself (a script's or a notebook's case):
the default group ends with it and the next Trainer starts its own. In a gloo world of 2, where the
default group is the harness's: tests/multirank/test_trainer_close.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.support.parity_runs import tiny_config
from tests.support.world_of_one import world_of_one


@pytest.mark.slow  # two Trainers, ~7 s: the full suite's
def test_a_trainer_that_started_the_default_group_ends_it_on_close(tmp_path, monkeypatch):
    from xorl._torch_compat import live_process_groups
    from xorl.trainer.trainer import Trainer

    world_of_one(monkeypatch)
    assert not dist.is_initialized()
    try:
        trainer = Trainer(tiny_config(str(tmp_path / "first"), "llama", max_steps=1))
        assert dist.is_initialized() and len(live_process_groups()) > 1  # the default, the mesh's, ...
        trainer.train()
        trainer.close()
        assert not dist.is_initialized() and live_process_groups() == set()
        trainer.close()  # again: nothing to do
        with Trainer(tiny_config(str(tmp_path / "second"), "llama", max_steps=1)):
            assert dist.is_initialized()  # started again, by the second Trainer
        assert not dist.is_initialized() and live_process_groups() == set()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
