"""Process-group start-up for the trainer: torchrun's environment, or one process without it."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Start the default process group (NCCL on GPU, gloo on CPU) and return this rank's device.

    Why a timeout on every collective: when a rank dies, the others must fail with an error inside
    the collective timeout instead of hanging (NCCL also needs async error handling for that).
    """
    # XORL_DIST_BACKEND overrides the backend, e.g. "cuda:gloo" (scripts/gpu_check.sh): a process
    # group that serves CUDA tensors only, like NCCL, which several ranks can share on one GPU.
    override = os.environ.get("XORL_DIST_BACKEND")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        visible = torch.cuda.device_count()
        if local_rank >= visible and override is None:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {visible} GPU(s) are visible: launch at most {visible} "
                "processes per node (torchrun --nproc_per_node)"
            )
        device, backend = torch.device("cuda", local_rank % visible), "nccl"
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    else:
        device, backend = torch.device("cpu"), "gloo"
    backend = override or backend
    if dist.is_initialized():
        return device
    # A plain `python -m xorl.cli.train`: a world of one. RANK alone does not mean a launcher (start-up
    # code may have set it for the world of one); a launcher always gives MASTER_ADDR.
    if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        # An in-process store: one process needs no port, so a MASTER_PORT left in the environment
        # (or taken by another job) cannot stop it.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
        return device
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def destroy_process_groups(groups: set, *, default: bool, compiled: bool = False) -> None:
    """Destroy ``groups`` (those one owner created: a Trainer's meshes, pipeline pairs, checkpoint
    group; emptied here), then the default group too where ``default`` and no other group is left.

    Why so much around ``destroy_process_group``: a gloo group's threads end only when its C++ object
    is freed, and torch keeps references past the destroy: DTensor's caches hold the meshes, compiled
    code (``compiled``) holds the meshes of the DTensors it traced, DeviceMesh views stay in the C++
    name registry, and the owner's modules and meshes form cycles only a collection frees. So the
    caches are cleared and garbage collected while the groups exist (collected after, FSDP states
    over HSDP meshes leave groups registered in C++), the registry is refilled with the groups that
    stay, and a last collection frees the rest. Groups another owner made (a second Trainer) stay,
    and so does the default group while they do.
    """
    import gc

    from xorl._torch_compat import (
        clear_mesh_caches,
        live_process_groups,
        release_compiled_code,
        reregister_process_groups,
    )

    clear_mesh_caches()
    if compiled:
        release_compiled_code()
    gc.collect()
    for group in groups & live_process_groups() - {dist.GroupMember.WORLD}:
        dist.destroy_process_group(group)
    groups.clear()
    group = None  # the loop's last group must not outlive the collection below
    remaining = live_process_groups()
    reregister_process_groups(remaining)
    if default and remaining <= {dist.GroupMember.WORLD} and dist.is_initialized():
        dist.destroy_process_group()
    remaining = None
    gc.collect()
