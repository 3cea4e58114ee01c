"""Sharded start: every layout starts from the weights of one process, each rank reading only its boxes.

The reference is ``initial_state_dict`` below (one process, the whole model) and, for a Hugging Face
folder, the tensors that were written into it. Both the seeded initialisation and the folder are
checked on FSDP, HSDP, TP, PP, EP and their mixes, with an uneven FSDP split and merge_qkv.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.parity_runs import tiny_config
from xorl.checkpoint.hf_export import full_state_dict
from xorl.distributed.shard_box import ShardBox
from xorl.models import seeded_init
from xorl.models.hf_writer import save_hf_weights
from xorl.models.registry import build_model
from xorl.trainer.trainer import initialise_part

LAYOUTS = [  # (id, model type, train overrides) on 4 ranks
    ("fsdp4 uneven rows merge_qkv", "llama", dict(data_parallel_shard_size=4)),
    ("fsdp2 x tp2", "llama", dict(data_parallel_shard_size=2, tensor_parallel_size=2, sequence_parallel=True)),
    ("fsdp2 x tp2 merge_qkv", "llama", dict(data_parallel_shard_size=2, tensor_parallel_size=2,
                                            sequence_parallel=True)),
    ("pp2 x tp2", "llama", dict(data_parallel_shard_size=1, pipeline_parallel_size=2, tensor_parallel_size=2,
                                sequence_parallel=True)),
    ("moe ep2 x fsdp4", "qwen3_moe", dict(data_parallel_shard_size=4, expert_parallel_size=2)),
    ("moe pp2 x ep2", "qwen3_moe", dict(data_parallel_shard_size=2, pipeline_parallel_size=2,
                                        expert_parallel_size=2)),
    ("moe hsdp 2x2 x ep2", "qwen3_moe", dict(data_parallel_replicate_size=2, data_parallel_shard_size=2,
                                             expert_parallel_size=2)),
]


def initial_state_dict(config) -> dict[str, torch.Tensor]:
    """The full initial weights in one process (the trainer's own initialise_part on an unsharded
    model): what every layout's sharded start must equal."""
    with torch.device("meta"):
        model = build_model(config.model)
    model.to_empty(device="cpu")
    model.tie_weights()
    initialise_part(model, config)
    return {k: v.to(torch.float32) for k, v in model.state_dict().items()}


def _config(output_dir: str, model_type: str, layout_id: str, model_path: str | None = None, **train):
    config = tiny_config(output_dir, model_type, **train)
    if "uneven" in layout_id:
        config.model.vocab_size = 275  # 275 rows over 4 FSDP ranks: 69, 69, 69, 68
    config.model.merge_qkv = config.model.merge_gate_up = "merge_qkv" in layout_id  # both fused projections
    config.model.model_path = model_path
    config.train.seed = 3
    return config


def start_and_gather(seeded, from_folder) -> dict:
    """On every rank: start a Trainer both ways; count the checkpoint elements this rank read."""
    from xorl.distributed.shard_box import local_tensor
    from xorl.models import hf_reader
    from xorl.trainer.trainer import Trainer

    out = {}
    trainer = Trainer(seeded)
    out["seeded"] = full_state_dict(trainer.parts, trainer.state.pp_group)
    read = {"elements": 0}
    original = hf_reader._SliceReader.__call__

    def counting(self, key, index):
        value = original(self, key, index)
        read["elements"] += value.numel()
        return value

    hf_reader._SliceReader.__call__ = counting
    try:
        trainer = Trainer(from_folder)
    finally:
        hf_reader._SliceReader.__call__ = original
    owned = {id(t): local_tensor(t).numel() for part in trainer.parts for t in part.state_dict(keep_vars=True).values()}
    out["read"], out["owned"] = read["elements"], sum(owned.values())
    out["from_folder"] = full_state_dict(trainer.parts, trainer.state.pp_group)
    return out if dist.get_rank() == 0 else {"read": out["read"], "owned": out["owned"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One HF folder per model type, in several files (a layer's experts span two), other numbers
    than the seeded start's."""
    cache = {}

    def get(model_type: str, layout_id: str) -> tuple[str, dict]:
        key = (model_type, "uneven" in layout_id)
        if key not in cache:
            source = _config("/unused", model_type, layout_id.replace("merge_qkv", ""))
            source.train.seed = 11
            weights = initial_state_dict(source)
            folder = str(tmp_path_factory.mktemp(f"hf-{model_type}"))
            save_hf_weights(weights, folder, source.model, max_shard_bytes=20_000)
            cache[key] = folder, weights
        return cache[key]

    return get


@pytest.mark.parametrize("layout_id,model_type,train", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_layout_starts_from_the_single_process_weights(layout_id, model_type, train, gloo_world, folders,
                                                       tmp_path):
    folder, written = folders(model_type, layout_id)
    seeded = _config(str(tmp_path / "seeded"), model_type, layout_id, **train)
    from_folder = _config(str(tmp_path / "hf"), model_type, layout_id, model_path=folder, **train)
    results = gloo_world(4).run(start_and_gather, seeded, from_folder, timeout_s=600)
    got = results[0]

    for name, reference in (("seeded", initial_state_dict(seeded)), ("from_folder", initial_state_dict(from_folder))):
        assert got[name].keys() == reference.keys(), name
        for key, value in reference.items():
            assert torch.equal(got[name][key], value), (name, key)
    if not seeded.model.merge_qkv:  # the folder's own tensors, under xorl's names and layouts
        assert all(torch.equal(got["from_folder"][k], v) for k, v in written.items())
    assert not torch.equal(got["seeded"]["model.norm.weight"], got["seeded"]["lm_head.weight"][0])
    total = sum(v.numel() for v in got["from_folder"].values())
    for rank, r in enumerate(results):  # each rank read exactly the elements its shards hold
        assert r["read"] == r["owned"] < total, (rank, r, total)


def test_seeded_values_depend_on_seed_name_and_block_only(monkeypatch):
    """A box of a parameter equals the same box cut from the whole parameter; blocks are seeded by
    (seed, name, block index), so another shape's split or another name gives other numbers."""
    monkeypatch.setattr(seeded_init, "BLOCK_ELEMENTS", 7 * 5)  # 7 rows of [*, 5] per block
    shape = (23, 5)
    whole = torch.empty(shape)
    seeded_init.fill_seeded_normal_(whole, ShardBox.whole(shape), seed=4, name="w", std=0.5)
    gen = torch.Generator().manual_seed(seeded_init.block_seed(4, "w", 1))
    block1 = torch.empty(7, 5).normal_(0.0, 0.5, generator=gen)
    assert torch.equal(whole[7:14], block1)
    for row0, rows, col0, cols in [(0, 23, 0, 5), (3, 9, 1, 3), (13, 1, 0, 5), (20, 3, 4, 1), (5, 0, 0, 5)]:
        box = ShardBox(shape, (row0, col0), (rows, cols))
        part = torch.full((rows, cols), float("nan"))
        seeded_init.fill_seeded_normal_(part, box, seed=4, name="w", std=0.5)
        assert torch.equal(part, whole[box.slices]), box
    other = torch.empty(shape)
    seeded_init.fill_seeded_normal_(other, ShardBox.whole(shape), seed=4, name="v", std=0.5)
    assert not torch.equal(other, whole)
    assert 0.4 < whole.std().item() < 0.6


def test_a_folder_that_does_not_fit_the_model_is_refused_before_any_process_group(tmp_path):
    from xorl.config.errors import ConfigError
    from xorl.config.model_path import model_path_weight_problems

    def check_model_path(config):
        problems = model_path_weight_problems(config)
        if problems:
            raise ConfigError(problems)

    config = _config(str(tmp_path / "run"), "llama", "")
    save_hf_weights(initial_state_dict(config), str(tmp_path / "hf"), config.model)
    config.model.model_path = str(tmp_path / "hf")
    check_model_path(config)  # fits: no error
    config.model.intermediate_size = 48
    with pytest.raises(ConfigError, match=r"model\.model_path=.*shape mismatch model\.layers\.0\.mlp\.down_proj"):
        check_model_path(config)
    config.model.model_path = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"model\.model_path=.*cannot read"):
        check_model_path(config)
