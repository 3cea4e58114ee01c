"""A NaN loss stops the run and says why (xorl/trainer/nonfinite.py): a NaN weight named at the first
step on every rank, the data or the last checkpoint named for finite weights, the step number."""

from __future__ import annotations

import os

from tests.support.fault_runs import hf_llama_folder
from tests.support.parity_runs import tiny_config, train_with_nan_at
from xorl.config import Config

FSDP2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)


def train_until_it_stops(config: Config) -> str:
    """Run the trainer; return the message of the NonFiniteLossError it stops with (ranks' check)."""
    from xorl.trainer.step import NonFiniteLossError
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    try:
        trainer.train()
    except NonFiniteLossError as err:
        return str(err)
    raise AssertionError("the trainer did not stop on a non-finite loss")


def test_a_nan_weight_is_named_at_the_first_step_on_every_rank(gloo_world, tmp_path):
    folder = str(tmp_path / "hf")
    hf_llama_folder(folder, nan_in="model.layers.2.mlp.down_proj.weight")
    config = tiny_config(str(tmp_path / "out"), max_steps=3, **FSDP2)
    config.model.model_path = folder
    messages = gloo_world(2).run(train_until_it_stops, config)
    for message in messages:
        assert "step 0: loss=nan" in message and "the initial weights are at fault" in message, message
        assert "model.layers.2.mlp.down_proj.weight holds NaN or inf values" in message
        assert f"model.model_path={folder!r}" in message
        assert "last good checkpoint" not in message and "No checkpoint was saved" in message


def test_a_nan_loss_with_finite_weights_blames_the_data_or_names_the_checkpoint(gloo_world, tmp_path):
    world = gloo_world(2)
    first = world.run(train_with_nan_at, tiny_config(str(tmp_path / "a"), max_steps=3, **FSDP2), 0)
    assert all("every initial weight finite" in m and "the first batch of data.dataset='builtin'" in m
               for m in first), first
    later = world.run(train_with_nan_at, tiny_config(str(tmp_path / "b"), max_steps=5, **FSDP2), 2)
    assert all("step 2" in m and "no checkpoint was saved before it" in m for m in later), later
    saved = world.run(train_with_nan_at, tiny_config(str(tmp_path / "c"), max_steps=5, save_steps=2, **FSDP2), 3)
    checkpoint = os.path.join(str(tmp_path / "c"), "checkpoints", "step_00000002")
    assert all(f"the last complete checkpoint is {checkpoint}" in m for m in saved), saved


def test_nan_loss_stops_with_the_step_number(gloo_world, tmp_path):
    world = gloo_world(2)
    messages = world.run(train_with_nan_at, tiny_config(str(tmp_path), max_steps=5, **FSDP2), 3)
    assert all("step 3" in m and "loss=nan" in m for m in messages)
