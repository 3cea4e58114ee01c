"""Independent rank arithmetic for ParallelState tests, and the per-rank observation of a built state.

The expected side never touches DeviceMesh: a rank's coordinates are its mixed-radix digits in the
mesh order (pp, dp_replicate, dp_shard, ringattn, ulysses, tp; tp fastest), and the group of a set
of dims is every rank that agrees with it on all other dims, in ascending rank order.
"""

from __future__ import annotations

import math
from typing import Any

DIMS = ("pp", "dp_replicate", "dp_shard", "ringattn", "ulysses", "tp")
FLAT = {
    "cp": ("ringattn", "ulysses"),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "ringattn", "ulysses"),
    "dp_cp": ("dp_replicate", "dp_shard", "ringattn", "ulysses"),
}
_KWARG_OF_DIM = {
    "pp": "pipeline_parallel_size",
    "dp_replicate": "data_parallel_replicate_size",
    "dp_shard": "data_parallel_shard_size",
    "ringattn": "ringattn_parallel_size",
    "ulysses": "ulysses_parallel_size",
    "tp": "tensor_parallel_size",
}


def mesh_sizes(world_size: int, layout: dict[str, Any]) -> dict[str, int]:
    sizes = {dim: layout.get(kw, -1 if dim == "dp_shard" else 1) for dim, kw in _KWARG_OF_DIM.items()}
    if sizes["dp_shard"] == -1:
        sizes["dp_shard"] = world_size // math.prod(v for d, v in sizes.items() if d != "dp_shard")
    assert math.prod(sizes.values()) == world_size, (layout, sizes)
    return sizes


def coords_of(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    coords = {}
    for dim in reversed(DIMS):
        rank, coords[dim] = divmod(rank, sizes[dim])
    return {dim: coords[dim] for dim in DIMS}


def ranks_varying(rank: int, sizes: dict[str, int], dims: tuple[str, ...]) -> list[int]:
    """Ranks that share ``rank``'s coordinates on every dim outside ``dims``."""
    me = coords_of(rank, sizes)
    fixed = [d for d in DIMS if d not in dims]
    world = math.prod(sizes.values())
    return [r for r in range(world) if all(coords_of(r, sizes)[d] == me[d] for d in fixed)]


def expected_state(rank: int, world_size: int, layout: dict[str, Any]) -> dict[str, Any]:
    sizes = mesh_sizes(world_size, layout)
    ep = layout.get("expert_parallel_size", 1)
    groups = {dim: ranks_varying(rank, sizes, (dim,)) for dim in DIMS}
    groups.update({name: ranks_varying(rank, sizes, dims) for name, dims in FLAT.items()})
    # EP folds over dp_shard x ringattn x ulysses x tp of this (pp, dp_replicate) coordinate, in that order.
    folded = ranks_varying(rank, sizes, ("dp_shard", "ringattn", "ulysses", "tp"))
    ep_rows = [folded[i : i + ep] for i in range(0, len(folded), ep)]
    my_row = next(row for row in ep_rows if rank in row)
    groups["ep"] = my_row
    groups["ep_fsdp"] = [row[my_row.index(rank)] for row in ep_rows]
    coords = coords_of(rank, sizes)
    coords["ep_fsdp"] = ep_rows.index(my_row)
    coords["ep"] = my_row.index(rank)
    if sizes["dp_replicate"] > 1:
        replica_of = {r: coords_of(r, sizes)["dp_replicate"] for r in groups["dp_cp"]}
        fsdp_mesh = [[r for r in groups["dp_cp"] if replica_of[r] == i] for i in range(sizes["dp_replicate"])]
    else:
        fsdp_mesh = groups["dp_shard_cp"]
    return {"coords": coords, "groups": groups, "ep_mesh": ep_rows, "fsdp_mesh": fsdp_mesh, "sizes": sizes}


# ParallelState's field prefix -> mesh view name (the fields are declared in the class; this checks them all).
SHORT_NAMES = {
    "pp": "pp", "dp_replicate": "dp_replicate", "dp_shard": "dp_shard", "ring": "ringattn", "ulysses": "ulysses",
    "tp": "tp", "cp": "cp", "dp": "dp", "dp_shard_cp": "dp_shard_cp", "dp_cp": "dp_cp", "ep_fsdp": "ep_fsdp",
    "ep": "ep",
}


def observe_state(state, collectives: bool) -> dict[str, Any]:
    """What a built ParallelState says about this rank (runs on the rank; returns plain data)."""
    import torch
    import torch.distributed as dist

    groups, meshes, gathered = {}, {}, {}
    for short, name in SHORT_NAMES.items():
        group = getattr(state, f"{short}_group")
        groups[name] = dist.get_process_group_ranks(group)
        meshes[name] = state.submesh(name).mesh.tolist()
        assert getattr(state, f"{short}_size") == len(groups[name])
        assert getattr(state, f"{short}_rank") == groups[name].index(dist.get_rank())
        if collectives:  # the group really carries data, in group-rank order
            out = [torch.full((1,), -1, dtype=torch.int64) for _ in groups[name]]
            dist.all_gather(out, torch.tensor([dist.get_rank()], dtype=torch.int64), group=group)
            gathered[name] = [int(t) for t in out]
    return {
        "coords": state.coordinates(),
        "groups": groups,
        "meshes": meshes,
        "gathered": gathered,
        "ep_mesh": state.ep_mesh.mesh.tolist(),
        "ep_mesh_dims": state.ep_mesh.mesh_dim_names,
        "fsdp_mesh": state.fsdp_mesh.mesh.tolist(),
        "first_last": (state.is_first_stage, state.is_last_stage),
    }


def compare(observed: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert observed["coords"] == expected["coords"], where
    for name, ranks in expected["groups"].items():
        assert observed["groups"][name] == ranks, f"{where}: group {name}"
        assert observed["meshes"][name] == ranks, f"{where}: mesh {name}"
        if observed["gathered"]:
            assert observed["gathered"][name] == ranks, f"{where}: all_gather over {name}"
    assert observed["ep_mesh"] == expected["ep_mesh"], f"{where}: ep_mesh"
    assert tuple(observed["ep_mesh_dims"]) == ("ep_fsdp", "ep"), where
    assert observed["fsdp_mesh"] == expected["fsdp_mesh"], f"{where}: fsdp_mesh"
    pp_rank, pp = expected["coords"]["pp"], expected["sizes"]["pp"]
    assert tuple(observed["first_last"]) == (pp_rank == 0, pp_rank == pp - 1), where
    # TP groups are consecutive ranks (innermost dim).
    tp = expected["groups"]["tp"]
    assert tp == list(range(tp[0], tp[0] + len(tp))), where
