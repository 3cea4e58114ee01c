"""Sharded checkpoints with torch.distributed.checkpoint (DCP), saved atomically.

Layout under ``output_dir/checkpoints``:
    step_00000010/        a complete DCP checkpoint (model, optimizer, scheduler, data step, RNG),
                          plus the trainer's plain files (run_config.yaml, trainer_state.json) and
                          manifest.json: every file's size, so a damaged folder is named before loading
    latest                a one-line file naming the newest complete checkpoint

Why atomic: a save goes to ``step_N.tmp`` first; only after every rank finished writing does
rank 0 rename it to ``step_N`` and then replace ``latest`` with ``os.replace`` (atomic on POSIX).
A crash at any point leaves the previous ``latest`` and its folder untouched.

Why DCP with the state-dict helpers: the state dict holds DTensors (FSDP / TP / EP shards); DCP
records the global shapes, so a checkpoint saved on one layout loads on another (say TP=2 saved,
FSDP-only resumed), each rank reading just its own shards. Model parts (pipeline stages, virtual
stages) keep the full model's parameter names and the optimizer state is flattened by name, so
the keys do not depend on how the model was split either.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from xorl.run_dir import LATEST, MANIFEST_NAME, checkpoint_root, latest_checkpoint  # noqa: F401 - re-exported

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(models, optimizers) -> tuple[dict, dict]:
    model_sd, optim_sd = {}, {}
    for model, optim in zip(models, optimizers):
        model_sd.update(get_model_state_dict(model, options=_OPTIONS))
        optim_sd.update(get_optimizer_state_dict(model, optim, options=_OPTIONS))
    return model_sd, optim_sd


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the folder (and file, when known)."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(output_dir: str, step: int, models: list[torch.nn.Module],
                    optimizers: list[torch.optim.Optimizer], extra: dict,
                    files: dict[str, str] | None = None) -> str:
    """Save model/optimizer shards plus ``extra`` (plain Python state, same on every rank) and
    ``files`` (name -> text, written by rank 0 into the folder before it becomes visible)."""
    root = checkpoint_root(output_dir)
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    if _is_rank0():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = _state(models, optimizers)
    dcp.save({"extra": extra, "model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    _barrier()
    if _is_rank0():
        _write_files(tmp, files or {})
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        pointer = os.path.join(root, LATEST + ".tmp")
        with open(pointer, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(root, LATEST))
    _barrier()
    return final


def _write_files(folder: str, files: dict[str, str]) -> None:
    """The plain files, then the manifest of every file's size (written last: it vouches for the rest)."""
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, MANIFEST_NAME), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(sizes.items())), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _check_metadata(path: str) -> None:
    """DCP's index of the shards, read first so a damaged one is named (DCP would log a fallback)."""
    metadata = os.path.join(path, ".metadata")
    try:
        dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling can fail in many ways; all mean "damaged"
        raise CheckpointError(f"cannot load checkpoint {path}: {metadata} is unreadable ({type(e).__name__}: "
                              f"{e}); resume from another checkpoint with --train.resume=PATH") from e


def _shard_files(path: str) -> str:
    """The data file(s) DCP reads, by name: DCP's error does not say which one failed."""
    storage = dcp.FileSystemReader(path).read_metadata().storage_data or {}
    files = sorted({os.path.join(path, info.relative_path) for info in storage.values()})
    return files[0] if len(files) == 1 else f"one of {len(files)} files: {', '.join(files[:4])}" + (
        ", ..." if len(files) > 4 else "")


@torch.no_grad()
def _materialise_optimizer_state(models, optimizers) -> None:
    """Create Adam's moment tensors (a step with zero gradients at lr 0) so DCP has slots to load into."""
    for model, optim in zip(models, optimizers):
        if optim.state:
            continue
        lrs = [group["lr"] for group in optim.param_groups]
        for group in optim.param_groups:
            group["lr"] = 0.0
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        optim.step()
        optim.zero_grad(set_to_none=True)
        for group, lr in zip(optim.param_groups, lrs):
            group["lr"] = lr


def load_checkpoint(path: str, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer],
                    extra_template: dict) -> dict:
    """Load into the (already parallelised) models and optimizers; return the saved ``extra``."""
    _materialise_optimizer_state(models, optimizers)
    model_sd, optim_sd = _state(models, optimizers)
    state = {"extra": dict(extra_template), "model": model_sd, "optim": optim_sd}
    _check_metadata(path)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException gathers every rank's failure
        lines = [line for line in str(e).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {reason} (reading {_shard_files(path)}); "
                              "resume from another checkpoint with --train.resume=PATH") from e
    for model, optim in zip(models, optimizers):
        # Each part takes the keys it owns; strict=False because the dicts hold every part's keys.
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optim, state["optim"], options=_OPTIONS)
    return state["extra"]
