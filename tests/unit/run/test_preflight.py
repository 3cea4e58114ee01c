"""prepare_run's verdicts on a run folder, on hand-made folders (no torch, no process group).

The end-to-end paths (a real run, resumed, refused, overwritten) are in tests/e2e/test_cli_runs.py;
these are the cases around them that need no training to set up."""

from __future__ import annotations

import json
import os

import pytest

import xorl.run.folder as run_dir
from xorl.config import Config, ConfigError
from xorl.run.preflight import prepare_run


def _config(output_dir, **train) -> Config:
    config = Config()
    config.train.output_dir = str(output_dir)
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


def _fake_checkpoint(output_dir, step: int, config: Config, latest: bool = True) -> str:
    """A checkpoint folder with the plain files the trainer writes (the DCP shards are stand-ins)."""
    path = os.path.join(run_dir.checkpoint_root(str(output_dir)), f"step_{step:08d}")
    os.makedirs(path)
    files = {"__0_0.distcp": "x" * 100, ".metadata": "m" * 10, run_dir.RUN_CONFIG_NAME: config.to_yaml(),
             run_dir.TRAINER_STATE_NAME: json.dumps({"step": step, "consumed_sequences": 2 * step,
                                                     "elapsed_s": 1.5, "global_batch": 2})}
    for name, text in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    with open(os.path.join(path, run_dir.MANIFEST_NAME), "w") as f:
        json.dump({name: len(text) for name, text in files.items()}, f)
    if latest:
        with open(os.path.join(run_dir.checkpoint_root(str(output_dir)), run_dir.LATEST), "w") as f:
            f.write(os.path.basename(path) + "\n")
    return path


def _refusal(config: Config, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        prepare_run(config, world_size)
    return str(info.value)


def test_overwrite_never_deletes_files_xorl_did_not_write(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("mine")
    message = _refusal(_config(tmp_path, overwrite_output_dir=True))
    assert "also holds notes.txt, which xorl did not write" in message
    os.remove(tmp_path / "notes.txt")
    setup = prepare_run(_config(tmp_path, overwrite_output_dir=True), 1)
    assert setup.overwrite and "removing the earlier run's metrics.jsonl" in setup.notes[0]
    run_dir.clear_output_dir(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_resume_and_overwrite_of_the_same_folder_contradict(tmp_path):
    _fake_checkpoint(tmp_path, 4, _config(tmp_path))
    message = _refusal(_config(tmp_path, resume=True, overwrite_output_dir=True))
    assert "would delete the checkpoint to resume" in message


def test_resuming_another_folders_checkpoint_into_a_used_folder_is_refused(tmp_path):
    source = _fake_checkpoint(tmp_path / "a", 4, _config(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    message = _refusal(_config(tmp_path / "b", resume=source))
    assert "is another folder's checkpoint" in message and "already holds metrics.jsonl" in message
    setup = prepare_run(_config(tmp_path / "c", resume=source), 1)  # an empty folder is fine
    assert setup.resume.path == source and setup.resume.step == 4 and setup.resume.consumed_sequences == 8


def test_resuming_an_older_checkpoint_beside_later_ones_is_refused(tmp_path):
    config = _config(tmp_path)
    older = _fake_checkpoint(tmp_path, 2, config, latest=False)
    _fake_checkpoint(tmp_path, 4, config)
    message = _refusal(_config(tmp_path, resume=older))
    assert "also holds the later step_00000004" in message


def test_step_folders_without_latest_are_not_silently_ignored(tmp_path):
    _fake_checkpoint(tmp_path, 2, _config(tmp_path), latest=False)
    assert "no complete checkpoint named by 'latest'" in _refusal(_config(tmp_path, resume=True))


def test_a_damaged_checkpoint_is_named_before_anything_loads(tmp_path):
    path = _fake_checkpoint(tmp_path, 2, _config(tmp_path))
    with open(os.path.join(path, "__0_0.distcp"), "w") as f:
        f.write("x" * 40)
    os.remove(os.path.join(path, ".metadata"))
    message = _refusal(_config(tmp_path, resume=True))
    assert f"checkpoint file {path}/__0_0.distcp has 40 bytes, 100 were written" in message
    assert f"checkpoint file {path}/.metadata is missing" in message


def test_fields_that_cannot_change_on_resume_are_refused_with_the_reason(tmp_path):
    _fake_checkpoint(tmp_path, 2, _config(tmp_path))
    config = _config(tmp_path, resume=True)
    config.model.hidden_size = 128
    config.data.seq_len = 64
    message = _refusal(config)
    assert "model.hidden_size 64 -> 128: the checkpoint's weights have that architecture" in message
    assert "data.seq_len 128 -> 64: the data position is counted in sequences" in message


def test_other_changes_apply_and_are_listed(tmp_path):
    _fake_checkpoint(tmp_path, 2, _config(tmp_path))
    config = _config(tmp_path, resume=True, max_grad_norm=0.5)
    config.data.micro_batch_size = 4
    setup = prepare_run(config, 1)
    notes = "\n".join(setup.notes)
    assert "applied as given: data.micro_batch_size 2 -> 4, train.max_grad_norm 1.0 -> 0.5" in notes
    assert "the global batch changed from 2 to 4 sequences a step; the data continues at sequence 4" in notes


def test_a_merged_qkv_checkpoint_in_the_older_row_order_is_refused(tmp_path):
    """Same name and shape as today's qkv_proj, other rows: loading it would mix heads silently."""
    saved = _config(tmp_path)
    saved.model.merge_qkv = True
    path = _fake_checkpoint(tmp_path, 2, saved)  # its trainer_state.json has no qkv_layout
    config = _config(tmp_path, resume=True)
    config.model.merge_qkv = True
    message = _refusal(config)
    assert "self_attn.qkv_proj is in the older [q; k; v] row order" in message and "xorl-export" in message
    state_file = os.path.join(path, run_dir.TRAINER_STATE_NAME)
    state = json.load(open(state_file))
    with open(state_file, "w") as f:
        json.dump({**state, "qkv_layout": "kv_groups"}, f)
    manifest = os.path.join(path, run_dir.MANIFEST_NAME)
    sizes = json.load(open(manifest))
    with open(manifest, "w") as f:
        json.dump({**sizes, run_dir.TRAINER_STATE_NAME: os.path.getsize(state_file)}, f)
    assert prepare_run(config, 1).resume is not None  # written by this xorl: resumes


def test_an_moe_checkpoint_with_separate_expert_gate_and_up_is_refused(tmp_path):
    """Saved before experts.gate_up_proj: DCP would fail only at load, after the process groups."""
    saved = _config(tmp_path)
    saved.model.model_type, saved.model.num_experts = "qwen3_moe", 4
    _fake_checkpoint(tmp_path, 2, saved)  # its trainer_state.json has no experts_layout
    config = _config(tmp_path, resume=True)
    config.model.model_type, config.model.num_experts = "qwen3_moe", 4
    message = _refusal(config)
    assert "its MoE experts hold gate_proj and up_proj apart" in message and "xorl-export" in message
