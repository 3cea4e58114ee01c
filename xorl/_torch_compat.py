"""Every private torch API xorl uses, in one place.

Why: torch renames or moves these between releases (the GPU machines run torch 2.11, the CPU suite
2.13), so a torch upgrade is checked and fixed here rather than across the tree. Each entry says
what it is for and why no public API does the job. Heavy modules are imported on first use, as
they were at the call sites.

Left outside on purpose: ``torch._check`` and ``torch._foreach_*`` (documented, stable); and
``PipelineStage.backward_maybe_with_nosync``, which xorl/parallel/pipeline_parallel.py overrides in a
subclass (an override, not a call: it cannot be wrapped here).
"""

from __future__ import annotations

import torch.distributed as dist


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under ``group_name``.

    Custom ops (torch.library) take no Python objects, so ring / Ulysses attention and the MoE
    all-to-all pass their group by name and look it up inside the op, as functional collectives do.
    """
    return dist.distributed_c10d._resolve_process_group(group_name)


def flatten_mesh(mesh, name: str):
    """A 1-D view of a multi-dim DeviceMesh slice (reuses its groups; no public equivalent)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes):
    """One DeviceMesh over the dims of several (HSDP: dp_replicate x dp_shard) without new groups."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def unflatten_mesh(mesh, dim: int, sizes, names):
    """Split one mesh dim into several named dims (expert parallel folds); dim as an int (torch 2.11)."""
    return mesh._unflatten(dim, sizes, names)


def compute_local_shape_and_global_offset(global_shape, mesh, placements):
    """(local shape, global offset) of this rank's piece of a DTensor layout, as DTensor computes it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    return compute(global_shape, mesh, placements)


def flatten_dense_tensors(tensors):
    """One flat buffer of ``tensors`` (bucketed gradient all-reduce), as DDP does it."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat, tensors):
    from torch._utils import _unflatten_dense_tensors

    return _unflatten_dense_tensors(flat, tensors)


def all_to_all_single_autograd(*args, **kwargs):
    """The differentiable functional all_to_all_single (the MoE dispatch; traceable by compile)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    return a2a(*args, **kwargs)


def checkpoint_wrapper(*args, **kwargs):
    """torch's activation-checkpoint module wrapper (FSDP2-compatible; no public home yet)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(*args, **kwargs)


def reregister_process_groups(keep) -> None:
    """Empty the C++ name -> group registry and register ``keep`` again (tests' group cleanup)."""
    from torch._C import _distributed_c10d as c10d

    if hasattr(c10d, "_unregister_all_process_groups"):
        c10d._unregister_all_process_groups()
        for group in keep:
            c10d._register_process_group(group.group_name, group)
