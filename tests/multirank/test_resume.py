"""Resuming a run from its checkpoint (xorl/run/resume.py, xorl/checkpoint/state.py): the losses of an
uninterrupted run, resume_hparams, and across a layout change (EP, TP, pipeline stages -> FSDP)."""

from __future__ import annotations

import shutil

import pytest

import xorl.checkpoint.state as ckpt
from tests.support.parity_runs import max_rel_diff, resume_and_report, tiny_config, train_losses
from xorl.trainer.optim import lr_factor

FSDP2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)


def test_resume_logs_the_same_losses_as_an_uninterrupted_run(gloo_world, tmp_path):
    world = gloo_world(2)
    full = world.run(train_losses, tiny_config(str(tmp_path / "full"), max_steps=6, **FSDP2))[0]
    run = str(tmp_path / "stopped")
    first = world.run(train_losses, tiny_config(run, max_steps=6, save_steps=3, **FSDP2), 3)[0]
    assert ckpt.latest_checkpoint(run).endswith("step_00000003")
    resumed = world.run(train_losses, tiny_config(run, max_steps=6, resume=True, **FSDP2))[0]
    assert len(resumed) == 3
    assert max_rel_diff(first + resumed, full) <= 1e-6


def test_resume_hparams_decide_which_settings_win(gloo_world, tmp_path):
    """resume_hparams=config puts every new value into the loaded param groups and schedule (the
    losses then differ); =checkpoint keeps the checkpoint's. Expected lrs come from lr_factor."""
    world = gloo_world(2)
    run = str(tmp_path / "run")
    world.run(train_losses, tiny_config(run, max_steps=6, save_steps=3, **FSDP2), 3)
    new = dict(lr=2e-2, min_lr_ratio=0.2, max_steps=8, weight_decay=0.3, adam_betas=(0.8, 0.99), adam_eps=1e-6)
    run_kept = str(tmp_path / "run_kept")  # each resume in its own copy: each run saves its last step
    shutil.copytree(run, run_kept)
    config_wins = world.run(resume_and_report, tiny_config(run, resume=True, resume_hparams="config",
                                                           **new, **FSDP2))[0]
    kept = world.run(resume_and_report, tiny_config(run_kept, resume=True, resume_hparams="checkpoint",
                                                    **new, **FSDP2))[0]
    decay, no_decay = config_wins["groups"]
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in config_wins["groups"])
    assert config_wins["steps"] == [3, 4, 5, 6, 7]
    assert config_wins["lrs"] == pytest.approx([2e-2 * lr_factor(s, 2, 8, 0.2) for s in range(3, 8)], rel=1e-12)
    assert kept["groups"][0]["weight_decay"] == 0.1 and kept["groups"][0]["betas"] == (0.9, 0.95)
    assert kept["steps"] == [3, 4, 5]
    # 3e-3: tiny_config's lr, which the checkpoint keeps
    assert kept["lrs"] == pytest.approx([3e-3 * lr_factor(s, 2, 6, 0.1) for s in range(3, 6)], rel=1e-12)
    # Step 3's loss comes before any update under the new settings; the next ones follow them.
    assert config_wins["losses"][0] == pytest.approx(kept["losses"][0], rel=1e-6)
    assert max_rel_diff(config_wins["losses"][1:3], kept["losses"][1:3]) > 1e-3


def test_moe_resume_under_expert_parallel(gloo_world, tmp_path):
    """Experts are DTensors of global shape, so EP checkpoints hold every expert exactly once."""
    ep2 = dict(data_parallel_shard_size=2, expert_parallel_size=2, gradient_accumulation_steps=2)
    world = gloo_world(2)
    full = world.run(train_losses, tiny_config(str(tmp_path / "full"), "qwen3_moe", max_steps=6, **ep2))[0]
    run = str(tmp_path / "ep")
    first = world.run(train_losses, tiny_config(run, "qwen3_moe", max_steps=6, save_steps=3, **ep2), 3)[0]
    # Resumed without expert parallelism: the saved experts must be whole.
    resumed = world.run(train_losses, tiny_config(run, "qwen3_moe", max_steps=6, resume=True,
                                                  data_parallel_shard_size=2, gradient_accumulation_steps=2))[0]
    assert max_rel_diff(first + resumed, full) <= 1e-5


@pytest.mark.parametrize("merge_qkv", [False, True])
def test_resume_across_a_layout_change(gloo_world, tmp_path, merge_qkv):
    """Saved under TP=2 (sequence parallel), resumed with FSDP only on the same 2 ranks; merged: the
    one qkv_proj and gate_up_proj saved by TP ranks (whole KV-head groups, paired units) read back whole."""
    tp2 = dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True,
               gradient_accumulation_steps=4)

    def config(out, **train):
        c = tiny_config(out, **train)
        c.model.merge_qkv = c.model.merge_gate_up = merge_qkv
        return c

    world = gloo_world(2)
    full = world.run(train_losses, config(str(tmp_path / "full"), max_steps=6, **FSDP2))[0]
    run = str(tmp_path / "tp")
    first = world.run(train_losses, config(run, max_steps=6, save_steps=3, **tp2), 3)[0]
    resumed = world.run(train_losses, config(run, max_steps=6, resume=True, **FSDP2))[0]
    assert max_rel_diff(first + resumed, full) <= 1e-5


def test_resume_from_pipeline_stages_into_fsdp(gloo_world, tmp_path):
    """Saved by 2 pipeline stages (each holding half the layers), resumed with FSDP over 2 ranks."""
    pp2 = dict(data_parallel_shard_size=1, pipeline_parallel_size=2, gradient_accumulation_steps=4)
    world = gloo_world(2)
    full = world.run(train_losses, tiny_config(str(tmp_path / "full"), max_steps=6, **FSDP2))[0]
    run = str(tmp_path / "pp")
    first = world.run(train_losses, tiny_config(run, max_steps=6, save_steps=3, **pp2), 3)[0]
    resumed = world.run(train_losses, tiny_config(run, max_steps=6, resume=True, **FSDP2))[0]
    assert max_rel_diff(first + resumed, full) <= 1e-5
