"""xorl-plan's parameter / gradient / optimizer bytes equal what the trainer's sharded model holds.

The real parallel model is built the trainer's way (meta device -> split_into_stages for PP ->
parallelize_model) under torch's fake process group, one process playing each probed rank in
turn, and the local shards of its parameters are counted (to_local on the meta device gives the
shapes; nothing is allocated). It runs in a subprocess so the test process keeps no default group.

Which ranks: ranks 0, 1, 6 and 7 of small 8-rank worlds whose dims chunk unevenly (the first and
last sharding ranks of each pipeline rank, so uneven counts are checked rank by rank, with the
claim that sharding index 0 holds the most); for the examples at their
stated world sizes, sharding index 0 of the first and the last pipeline rank (TP and EP split
evenly, FSDP2 chunks dim 0 like torch.chunk, and the embedding and lm_head sit on the first and
last stage; the middle ranks run the same kinds of layers, checked rank by rank on the small PP
layouts). The two probes run side by side.
Gradients are not built here: FSDP2's sharded gradient has the sharded parameter's shape and the
master dtype, so their bytes follow the parameters'. The optimizer's state is built for real (an
AdamW step on the meta device) on two small layouts (TP and EP DTensors under FSDP2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.support.paths import REPO_ROOT
from tests.unit.config.test_examples import EXAMPLES, _world_size
from xorl.config import Config, load_config
from xorl.distributed.parallel_config import ParallelConfig
from xorl.planner.shapes import model_shapes, rank_params

REPO_ROOT = REPO_ROOT

TINY_DENSE = {"vocab_size": 275, "hidden_size": 40, "intermediate_size": 72, "num_hidden_layers": 5,
              "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_MOE = {**TINY_DENSE, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2,
            "moe_intermediate_size": 24, "mlp_only_layers": [0]}
SMALL_RANKS = [0, 1, 6, 7]
# (model fields, train fields, build the optimizer too); all on 8 ranks.
SMALL = [
    (TINY_DENSE, {"data_parallel_shard_size": 8}, False),
    (TINY_DENSE, {"tensor_parallel_size": 2, "sequence_parallel": True}, True),
    (TINY_DENSE, {"pipeline_parallel_size": 2, "pipeline_parallel_schedule": "Interleaved1F1B",
                  "virtual_pipeline_stages": 2, "tensor_parallel_size": 2, "gradient_accumulation_steps": 2}, False),
    (TINY_DENSE, {"data_parallel_replicate_size": 2, "ringattn_parallel_size": 2}, False),
    (TINY_DENSE, {"data_parallel_mode": "ddp", "ringattn_parallel_size": 2}, False),
    (TINY_MOE, {"expert_parallel_size": 2}, True),
    (TINY_MOE, {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2}, False),
    # TP without EP: the experts, whole on each TP rank, are FSDP-sharded over the TP ranks too
    (TINY_MOE, {"tensor_parallel_size": 2, "sequence_parallel": True}, False),
    (TINY_MOE, {"pipeline_parallel_size": 2, "pipeline_parallel_schedule": "ZBVZeroBubble",
                "virtual_pipeline_stages": 2, "gradient_accumulation_steps": 2, "expert_parallel_size": 2}, False),
]


def _probe_main() -> None:
    """Subprocess entry: JSON [[config dict, world, ranks, with optimizer], ...] on stdin -> per-rank counts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from xorl.distributed.parallel_state import init_parallel_state
    from xorl.models.registry import build_model
    from xorl.parallel.parallelize import parallelize_model
    from xorl.parallel.pipeline_parallel import split_into_stages

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    results = []
    for config_dict, world_size, ranks, with_optimizer in json.load(sys.stdin):
        config = Config.from_dict(config_dict)
        for rank in ranks:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                state = init_parallel_state(ParallelConfig.from_config(config, world_size), device_type="cpu")
                with torch.device("meta"):
                    model = build_model(config.model)
                stages = split_into_stages(model, state, config).stages if state.pp_size > 1 else [model]
                parts = [parallelize_model(stage, state, config).module for stage in stages]
                params = [p for part in parts for p in part.parameters()]
                out = {"rank": rank, "pp_rank": state.pp_rank, "shard_rank": state.dp_shard_cp_rank,
                       "numel": sum(local(p).numel() for p in params),
                       "dtypes": sorted({str(local(p).dtype) for p in params})}
                if with_optimizer:
                    optimizer = torch.optim.AdamW(params, foreach=True)
                    for p in params:
                        p.grad = torch.zeros_like(p)
                    optimizer.step()
                    out["optimizer_device_bytes"] = sum(
                        local(v).numel() * local(v).element_size()
                        for s in optimizer.state.values() for v in s.values() if local(v).device.type != "cpu")
                results.append(out)
            finally:
                dist.destroy_process_group()
    json.dump(results, sys.stdout)


def _start_probe(jobs: list) -> subprocess.Popen:
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as f:
        json.dump(jobs, f)
        f.seek(0)
        return subprocess.Popen(
            [sys.executable, "-c", "from tests.unit.planner.test_memory import _probe_main; _probe_main()"],
            stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        )


def _result(proc: subprocess.Popen) -> list[dict]:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out)


def _small_jobs() -> list:
    return [[_small_config(m, t).to_dict(), 8, SMALL_RANKS, opt] for m, t, opt in SMALL]


def _example_jobs() -> list:
    jobs = []
    for path in EXAMPLES:
        config, world = load_config(path), _world_size(path)
        pp = config.train.pipeline_parallel_size
        jobs.append([config.to_dict(), world, sorted({0, (pp - 1) * (world // pp)}), False])
    return jobs


@pytest.fixture(scope="module")
def probes():
    """Both probes at once (CI has two cores): the small layouts and the examples."""
    small, examples = _start_probe(_small_jobs()), _start_probe(_example_jobs())
    return {"small": small, "examples": examples}


def _planned(config: Config, world_size: int, pp_rank: int, shard_rank: int) -> int:
    p = ParallelConfig.from_config(config, world_size)
    t = config.train
    return rank_params(model_shapes(config.model), p, t.pipeline_parallel_schedule, t.virtual_pipeline_stages,
                       pp_rank, t.data_parallel_mode == "fsdp2", shard_rank).local


def _small_config(model: dict, train: dict) -> Config:
    config = Config.from_dict({"model": model, "data": {"seq_len": 16}, "train": train})
    config.validate(8)
    return config


@pytest.mark.slow
def test_every_rank_of_small_layouts_matches_the_sharded_model(probes):
    configs = [_small_config(model, train) for model, train, _ in SMALL]
    observed = iter(_result(probes["small"]))
    for config, (_, train, with_optimizer) in zip(configs, SMALL):
        per_rank = [next(observed) for _ in SMALL_RANKS]
        for got in per_rank:
            assert got["dtypes"] == ["torch.float32"], got  # fp32 master weights: 4 bytes each
            planned = _planned(config, 8, got["pp_rank"], got["shard_rank"])
            assert planned == got["numel"], (train, got)
            if with_optimizer:  # exp_avg + exp_avg_sq, fp32, like each local parameter
                assert got["optimizer_device_bytes"] == 2 * 4 * planned, (train, got)
            # Sharding index 0 holds the most, so the planner's maximum is the maximum over ranks.
            assert got["numel"] <= _planned(config, 8, got["pp_rank"], 0), (train, got)
        if train.get("data_parallel_shard_size") == 8:  # dims that do not divide by 8: ranks differ
            assert len({g["numel"] for g in per_rank}) > 1


@pytest.mark.slow
def test_examples_at_their_world_size_match_the_sharded_model(probes):
    observed = iter(_result(probes["examples"]))
    for path, (config_dict, world, ranks, _) in zip(EXAMPLES, _example_jobs()):
        config = Config.from_dict(config_dict)
        for _ in ranks:
            got = next(observed)
            assert got["shard_rank"] == 0 and got["dtypes"] == ["torch.float32"]
            assert _planned(config, world, got["pp_rank"], 0) == got["numel"], (os.path.basename(path), got)


def test_model_shapes_are_the_built_models():
    config = _small_config(TINY_MOE, {"expert_parallel_size": 2})
    import torch

    from xorl.models.registry import build_model
    from xorl.parallel.expert_parallel import apply_expert_parallel

    with torch.device("meta"):
        model = build_model(config.model)
    apply_expert_parallel(model, None)
    assert model_shapes(config.model).num_params == sum(p.numel() for p in model.parameters())
