"""ParallelState on real gloo worlds of 1, 2, 4 and 8 ranks.

Every rank builds several layouts; its coordinates, group memberships, mesh views, EP mesh and
FSDP mesh are compared with rank arithmetic done independently (tests/support/parallel_layouts.py), and
an all_gather over every group checks that the group really carries data in group-rank order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.support.parallel_layouts import compare, expected_state, observe_state
from xorl.config.errors import ConfigError
from xorl.distributed import ParallelConfig, init_parallel_state

GAS = {"gradient_accumulation_steps": 2}
LAYOUTS = {
    1: [{}],
    2: [
        {},
        {"tensor_parallel_size": 2},
        {"ringattn_parallel_size": 2},
        {"pipeline_parallel_size": 2, **GAS},
        {"expert_parallel_size": 2},
        {"data_parallel_replicate_size": 2},
    ],
    4: [
        {"data_parallel_replicate_size": 2},  # HSDP 2 x 2
        {"tensor_parallel_size": 2},
        {"ringattn_parallel_size": 2, "ulysses_parallel_size": 2},
        {"pipeline_parallel_size": 2, "expert_parallel_size": 2, **GAS},
    ],
    8: [
        {},  # FSDP 8
        {"tensor_parallel_size": 2, "ringattn_parallel_size": 2},  # FSDP 2 x TP 2 x ring 2
        {"pipeline_parallel_size": 2, "ulysses_parallel_size": 2, "tensor_parallel_size": 2, **GAS},
        {"data_parallel_replicate_size": 2, "data_parallel_shard_size": 2, "tensor_parallel_size": 2},
        # PP 2 x EP 4 folded over CP 4 (ring 2 x ulysses 2)
        {"pipeline_parallel_size": 2, "ringattn_parallel_size": 2, "ulysses_parallel_size": 2,
         "expert_parallel_size": 4, **GAS},
    ],
}


def _build_and_observe(layouts: list[dict]) -> list[dict]:
    return [observe_state(init_parallel_state(ParallelConfig(**layout)), collectives=True) for layout in layouts]


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_match_rank_arithmetic(gloo_world, world_size):
    world = gloo_world(world_size)
    results = world.run(_build_and_observe, LAYOUTS[world_size])
    for rank, per_rank in enumerate(results):
        for layout, observed in zip(LAYOUTS[world_size], per_rank, strict=True):
            compare(observed, expected_state(rank, world_size, layout), f"rank {rank} of {world_size}, {layout}")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _fully_shard_on_state_meshes() -> dict[str, float]:
    """fully_shard accepts fsdp_mesh (2-D, HSDP) and ep_mesh["ep_fsdp"]; outputs and grads match one process."""
    from torch.distributed.fsdp import fully_shard

    state = init_parallel_state(
        ParallelConfig(data_parallel_replicate_size=2, tensor_parallel_size=2, expert_parallel_size=2)
    )
    errors = {}
    for name, mesh in (("fsdp_mesh", state.fsdp_mesh), ("ep_fsdp", state.ep_mesh["ep_fsdp"])):
        torch.manual_seed(1234)  # same weights and inputs on every rank
        ref = torch.nn.Linear(6, 5)
        x = torch.randn(3, 6)
        sharded = fully_shard(copy.deepcopy(ref), mesh=mesh)
        out = sharded(x)
        out.square().sum().backward()
        ref_out = ref(x)
        ref_out.square().sum().backward()
        errors[f"{name} out"] = _rel_err(out, ref_out)
        # FSDP averages gradients over its ranks; every rank saw the same data, so the mean is the reference.
        errors[f"{name} grad"] = _rel_err(sharded.weight.grad.full_tensor(), ref.weight.grad)
    return errors


def test_fully_shard_accepts_state_meshes(gloo_world):
    for rank, errors in enumerate(gloo_world(8).run(_fully_shard_on_state_meshes)):
        for what, err in errors.items():
            assert err < 1e-6, f"rank {rank}: {what} relative error {err}"


def _init_with(config: ParallelConfig) -> str:
    try:
        init_parallel_state(config)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_bad_configs_fail_on_every_rank_before_any_group(gloo_world):
    world = gloo_world(2)
    # Every rank raises (no rank is left waiting in a collective), and the world stays usable.
    messages = world.run(_init_with, ParallelConfig(world_size=4))
    assert all("world_size=4" in m and "2 ranks" in m for m in messages), messages
    messages = world.run(_init_with, ParallelConfig(tensor_parallel_size=3))
    assert all("tensor_parallel_size=3" in m for m in messages), messages
    assert world.run(_all_reduce_ones) == [2.0, 2.0]


def _all_reduce_ones() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
