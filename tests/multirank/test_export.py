"""Export to Hugging Face, streamed from the DCP checkpoint: files and index as transformers writes
them, the trained weights exactly, every rank writing some files, atomic, and ``xorl-export``."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch
import torch.distributed as dist

import xorl.checkpoint.hf_export as export_module
from tests.support.parity_runs import tiny_config
from xorl.checkpoint.hf_export import export_checkpoint, full_state_dict
from xorl.cli.export import main as xorl_export
from xorl.models.hf_writer import iter_hf_tensors
from xorl.models.spec import ModelSpec

SHARD_BYTES = 60_000  # a tiny model in several files, so both ranks write some


def train_and_export(config, folder: str) -> dict:
    """On every rank: train, export with small files; rank 0 returns the trained weights, gathered."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    trainer.train()
    trainer.export_hf(folder, max_shard_bytes=SHARD_BYTES)
    full = full_state_dict(trainer.parts, trainer.state.pp_group)
    return full if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def runs(gloo_world, tmp_path_factory):
    """Llama under FSDP 2 and Qwen3-MoE (merge_qkv) under EP 2 x FSDP 2, each trained 2 steps and exported."""
    out = {}
    for name, model_type, train in (("llama", "llama", dict(data_parallel_shard_size=2)),
                                    ("moe", "qwen3_moe", dict(data_parallel_shard_size=2, expert_parallel_size=2))):
        run = str(tmp_path_factory.mktemp(name))
        config = tiny_config(run, model_type, max_steps=2, **train)
        config.model.merge_qkv = name == "moe"
        weights = gloo_world(2).run(train_and_export, config, os.path.join(run, "hf"))[0]
        out[name] = {"run": run, "hf": os.path.join(run, "hf"), "config": config, "weights": weights}
    return out


def _hf_reference(run: dict) -> dict[str, torch.Tensor]:
    spec = ModelSpec.from_config(run["config"].model)
    return {name: tensor.contiguous() for name, tensor in iter_hf_tensors(run["weights"], spec)}


@pytest.mark.parametrize("name", ["llama", "moe"])
def test_export_loads_in_transformers_with_the_trained_weights(runs, name):
    transformers = pytest.importorskip("transformers")
    run = runs[name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(run["hf"], dtype=torch.float32)
    reference = _hf_reference(run)
    from safetensors.torch import load_file

    files = [f for f in os.listdir(run["hf"]) if f.endswith(".safetensors")]
    written = {k: v for f in files for k, v in load_file(os.path.join(run["hf"], f)).items()}
    assert written.keys() == reference.keys()
    assert all(torch.equal(written[k], v) for k, v in reference.items())
    assert len(files) > 2 and not os.path.exists(run["hf"] + ".partial")
    if name == "llama":  # transformers keeps Llama's names in memory: compare its view too
        state = hf.state_dict()
        assert all(torch.equal(state[k], v) for k, v in reference.items())
    report = json.load(open(os.path.join(run["run"], "export.json")))
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and report["files"] == len(files)


def test_files_and_index_are_split_and_named_as_transformers_writes_them(runs):
    """huggingface_hub's splitter (what save_pretrained calls), on the same tensors in the same
    order, gives exactly our files; the index is written as transformers writes it."""
    hub = pytest.importorskip("huggingface_hub")
    from safetensors import safe_open

    ours = runs["llama"]["hf"]
    text = open(os.path.join(ours, "model.safetensors.index.json")).read()
    index = json.loads(text)
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    parameters = 0
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(ours, file), framework="pt") as f:
            parameters += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    split = hub.split_torch_state_dict_into_shards(_hf_reference(runs["llama"]), max_shard_size=SHARD_BYTES,
                                                   filename_pattern="model{suffix}.safetensors")
    assert split.is_sharded and split.tensor_to_filename == index["weight_map"]
    assert index["metadata"] == {"total_size": split.metadata["total_size"], "total_parameters": parameters}


def test_a_crash_mid_export_never_leaves_a_complete_looking_folder(runs, tmp_path, monkeypatch):
    run = runs["llama"]
    checkpoint = os.path.join(run["run"], "checkpoints", "step_00000002")
    folder = str(tmp_path / "hf")
    export_checkpoint(checkpoint, folder, run["config"].model, max_shard_bytes=SHARD_BYTES)
    before = {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}
    original, calls = export_module.write_safetensors, []

    def crash_on_second_file(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (planted)")
        original(*args)

    monkeypatch.setattr(export_module, "write_safetensors", crash_on_second_file)
    with pytest.raises(OSError, match="planted"):  # over a previous export: that one stays as it was
        export_checkpoint(checkpoint, folder, run["config"].model, max_shard_bytes=SHARD_BYTES)
    assert {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)} == before
    calls.clear()
    fresh = str(tmp_path / "fresh")
    with pytest.raises(OSError, match="planted"):  # into a new folder: no folder of that name at all
        export_checkpoint(checkpoint, fresh, run["config"].model, max_shard_bytes=SHARD_BYTES)
    assert not os.path.exists(fresh) and os.path.isdir(fresh + ".partial")
    monkeypatch.setattr(export_module, "write_safetensors", original)
    export_checkpoint(checkpoint, fresh, run["config"].model, max_shard_bytes=SHARD_BYTES)
    assert not os.path.exists(fresh + ".partial") and sorted(os.listdir(fresh)) == sorted(before)


def test_xorl_export_writes_what_the_training_export_wrote(runs, tmp_path, capsys):
    run = runs["moe"]
    out = str(tmp_path / "cli")
    # From the run's output_dir: the checkpoint `latest` names; one process, no process group.
    assert xorl_export([run["run"], out, "--max-shard-size", str(SHARD_BYTES)]) == 0
    names = sorted(os.listdir(run["hf"]))
    assert sorted(os.listdir(out)) == names
    assert filecmp.cmpfiles(run["hf"], out, names, shallow=False)[0] == names

    assert xorl_export([run["run"], out]) == 2  # never over an existing folder
    assert "exists" in capsys.readouterr().err and sorted(os.listdir(out)) == names
    assert xorl_export([str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    assert xorl_export([run["run"], str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")

    half = str(tmp_path / "bf16")
    assert xorl_export([run["run"], half, "--dtype", "bfloat16"]) == 0
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(half, "model.safetensors"))
    reference = _hf_reference(run)
    assert tensors.keys() == reference.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, reference[k].bfloat16()) for k, t in tensors.items())
    assert json.load(open(os.path.join(half, "config.json")))["dtype"] == "bfloat16"
