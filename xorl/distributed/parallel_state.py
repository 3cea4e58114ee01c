"""ParallelState: the run's DeviceMesh, its flattened views, the EP mesh, and this rank's place in them.

    dist.init_process_group("nccl")                      # or gloo on CPU
    state = init_parallel_state(ParallelConfig(tensor_parallel_size=2, ringattn_parallel_size=2))
    state.tp_group, state.cp_group, state.fsdp_mesh, state.ep_mesh, state.coordinates()

The mesh has every dimension, size-1 ones included, outer to inner:
``("pp", "dp_replicate", "dp_shard", "ringattn", "ulysses", "tp")``, so TP groups are consecutive
ranks (innermost: inside a node), then Ulysses, then ring.

Flattened 1-D views (also reachable as ``state.mesh[name]``):
  cp          = ringattn x ulysses                         the whole context-parallel group
  dp          = dp_replicate x dp_shard                    ranks that read different data
  dp_shard_cp = dp_shard x ringattn x ulysses              the FSDP sharding group (CP ranks hold
                                                           the same weights, so they shard them)
  dp_cp       = dp_replicate x dp_shard x ringattn x ulysses   loss / gradient averaging
``fsdp_mesh`` is what ``fully_shard`` takes: ``dp_shard_cp`` (1-D), or ``(dp_replicate, dp_shard_cp)``
(2-D, HSDP) when data_parallel_replicate_size > 1.

The EP mesh (always built; with expert_parallel_size 1 its "ep" dim has size 1): within one
(pp, dp_replicate) coordinate, the dp_shard x ringattn x ulysses x tp ranks in their flattened
order ("ep_fold") are split as ``("ep_fsdp", "ep")`` = (ep_fold / ep, ep). EP groups are
consecutive in that order, so EP stays on the innermost (fastest) ranks, the TP ranks of a node
first; expert weights are FSDP-sharded over "ep_fsdp".

Fields (declared in the class), for each short name in ``pp, dp_replicate, dp_shard, ring
(ringattn), ulysses, tp, cp, dp, dp_shard_cp, dp_cp, ep_fsdp, ep``: ``<name>_size``, ``<name>_rank``
(this rank's index in its group), ``<name>_group`` (ProcessGroup) and ``<name>_mesh`` (1-D
DeviceMesh; except ``ep_mesh``, the 2-D EP mesh above, whose 1-D "ep" view is ``submesh("ep")``). Prefer these views to
``state.mesh["cp"]``: slicing a flattened name from the root mesh is deprecated in torch >= 2.11.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from xorl._torch_compat import concatenate_meshes, flatten_mesh, unflatten_mesh
from xorl.config.errors import ConfigError
from xorl.distributed.parallel_config import MESH_DIM_NAMES, ParallelConfig

FLATTENED_DIMS = {
    "cp": ("ringattn", "ulysses"),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "ringattn", "ulysses"),
    "dp_cp": ("dp_replicate", "dp_shard", "ringattn", "ulysses"),
    # With TP, MoE blocks run on each TP rank's token shard: these cover every rank holding
    # different tokens (expert parallelism folds over the first, router statistics use the others).
    "ep_fold": ("dp_shard", "ringattn", "ulysses", "tp"),
    "cp_tp": ("ringattn", "ulysses", "tp"),
    "dp_cp_tp": ("dp_replicate", "dp_shard", "ringattn", "ulysses", "tp"),
}
EP_DIM_NAMES = ("ep_fsdp", "ep")


def _axis(view: DeviceMesh) -> tuple[DeviceMesh, dist.ProcessGroup, int, int]:
    """(1-D mesh, its process group, its size, this rank's index in it)."""
    return view, view.get_group(), view.size(), view.get_local_rank()


class ParallelState:
    """Meshes, groups, sizes and ranks of one run. Build with ``init_parallel_state``.

    Every field is declared here, so grep and editors find where ``state.ring_group`` comes from.
    """

    config: ParallelConfig
    mesh: DeviceMesh  # the full mesh, dims MESH_DIM_NAMES
    fsdp_mesh: DeviceMesh  # what fully_shard takes: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP
    ep_mesh: DeviceMesh  # 2-D ("ep_fsdp", "ep"); its 1-D "ep" view is ep_group's mesh
    # One axis per mesh dim: mesh (1-D), group, size and this rank's index.
    pp_mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    pp_size: int
    pp_rank: int
    dp_replicate_mesh: DeviceMesh
    dp_replicate_group: dist.ProcessGroup
    dp_replicate_size: int
    dp_replicate_rank: int
    dp_shard_mesh: DeviceMesh
    dp_shard_group: dist.ProcessGroup
    dp_shard_size: int
    dp_shard_rank: int
    ring_mesh: DeviceMesh  # the "ringattn" dim
    ring_group: dist.ProcessGroup
    ring_size: int
    ring_rank: int
    ulysses_mesh: DeviceMesh
    ulysses_group: dist.ProcessGroup
    ulysses_size: int
    ulysses_rank: int
    tp_mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    tp_size: int
    tp_rank: int
    # Flattened views (FLATTENED_DIMS).
    cp_mesh: DeviceMesh
    cp_group: dist.ProcessGroup
    cp_size: int
    cp_rank: int
    dp_mesh: DeviceMesh
    dp_group: dist.ProcessGroup
    dp_size: int
    dp_rank: int
    dp_shard_cp_mesh: DeviceMesh
    dp_shard_cp_group: dist.ProcessGroup
    dp_shard_cp_size: int
    dp_shard_cp_rank: int
    dp_cp_mesh: DeviceMesh
    dp_cp_group: dist.ProcessGroup
    dp_cp_size: int
    dp_cp_rank: int
    # Every rank of a microbatch's tokens (cp x tp) and of a round's (dp x cp x tp): MoE under TP.
    cp_tp_group: dist.ProcessGroup
    cp_tp_size: int
    dp_cp_tp_group: dist.ProcessGroup
    dp_cp_tp_size: int
    # The EP mesh's dims (ep_mesh above is the 2-D mesh; its "ep" view is submesh("ep")).
    ep_fsdp_mesh: DeviceMesh
    ep_fsdp_group: dist.ProcessGroup
    ep_fsdp_size: int
    ep_fsdp_rank: int
    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int

    def __init__(self, config: ParallelConfig, mesh: DeviceMesh, views: dict[str, DeviceMesh],
                 fsdp_mesh: DeviceMesh, ep_mesh: DeviceMesh):
        self.config = config
        self.mesh = mesh
        self.fsdp_mesh = fsdp_mesh
        self.ep_mesh = ep_mesh
        self._views = views
        self.device_type = mesh.device_type
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.pp_mesh, self.pp_group, self.pp_size, self.pp_rank = _axis(views["pp"])
        (self.dp_replicate_mesh, self.dp_replicate_group, self.dp_replicate_size,
         self.dp_replicate_rank) = _axis(views["dp_replicate"])
        self.dp_shard_mesh, self.dp_shard_group, self.dp_shard_size, self.dp_shard_rank = _axis(views["dp_shard"])
        self.ring_mesh, self.ring_group, self.ring_size, self.ring_rank = _axis(views["ringattn"])
        self.ulysses_mesh, self.ulysses_group, self.ulysses_size, self.ulysses_rank = _axis(views["ulysses"])
        self.tp_mesh, self.tp_group, self.tp_size, self.tp_rank = _axis(views["tp"])
        self.cp_mesh, self.cp_group, self.cp_size, self.cp_rank = _axis(views["cp"])
        self.dp_mesh, self.dp_group, self.dp_size, self.dp_rank = _axis(views["dp"])
        (self.dp_shard_cp_mesh, self.dp_shard_cp_group, self.dp_shard_cp_size,
         self.dp_shard_cp_rank) = _axis(views["dp_shard_cp"])
        self.dp_cp_mesh, self.dp_cp_group, self.dp_cp_size, self.dp_cp_rank = _axis(views["dp_cp"])
        _, self.cp_tp_group, self.cp_tp_size, _ = _axis(views["cp_tp"])
        _, self.dp_cp_tp_group, self.dp_cp_tp_size, _ = _axis(views["dp_cp_tp"])
        self.ep_fsdp_mesh, self.ep_fsdp_group, self.ep_fsdp_size, self.ep_fsdp_rank = _axis(views["ep_fsdp"])
        _, self.ep_group, self.ep_size, self.ep_rank = _axis(views["ep"])

    def submesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of a mesh dim, a flattened view or an EP dim, by name (e.g. "ringattn", "dp_cp")."""
        if name not in self._views:
            raise KeyError(f"no mesh view named {name!r}; the views are {sorted(self._views)}")
        return self._views[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.submesh(name).get_group()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def coordinates(self) -> dict[str, int]:
        """This rank's index along every mesh dim and EP dim."""
        coords = dict(zip(MESH_DIM_NAMES, self.mesh.get_coordinate()))
        coords.update(zip(EP_DIM_NAMES, self.ep_mesh.get_coordinate()))
        return coords

    def __repr__(self) -> str:
        sizes = " ".join(f"{n}={self._views[n].size()}" for n in (*MESH_DIM_NAMES, "ep"))
        return f"ParallelState(rank={self.rank}/{self.world_size}, {sizes}, coordinates={self.coordinates()})"


def init_parallel_state(config: ParallelConfig, device_type: str | None = None) -> ParallelState:
    """Build the meshes of ``config`` on the current default process group (all ranks, same order).

    ``config.world_size`` None means the process group's size. ``device_type`` None: "cuda" when the
    default backend is NCCL, else "cpu".
    """
    if not dist.is_initialized():
        raise RuntimeError("init_parallel_state needs torch.distributed.init_process_group() first")
    world_size = dist.get_world_size()
    if config.world_size is None:
        config = dataclasses.replace(config, world_size=world_size)
    elif config.world_size != world_size:
        raise ConfigError(
            f"ParallelConfig.world_size={config.world_size} but the process group has {world_size} ranks; "
            "build it with ParallelConfig.from_config(config, dist.get_world_size()) or leave world_size None"
        )
    config.validate()
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"

    mesh = init_device_mesh(device_type, config.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    views = {name: mesh[name] for name in MESH_DIM_NAMES}
    for name, dims in FLATTENED_DIMS.items():
        views[name] = flatten_mesh(mesh[dims], name)
    if config.dp_replicate > 1:
        # Reuses the dp_replicate and dp_shard_cp groups rather than creating new ones.
        fsdp_mesh = concatenate_meshes([views["dp_replicate"], views["dp_shard_cp"]])
    else:
        fsdp_mesh = views["dp_shard_cp"]
    # dim 0 as an int: torch 2.11's _unflatten rejects a dim given by name.
    ep_mesh = unflatten_mesh(views["ep_fold"], 0, (config.ep_fsdp, config.ep), EP_DIM_NAMES)
    for name in EP_DIM_NAMES:
        views[name] = ep_mesh[name]
    return ParallelState(config, mesh, views, fsdp_mesh, ep_mesh)


__all__ = ["EP_DIM_NAMES", "FLATTENED_DIMS", "ParallelState", "init_parallel_state"]
