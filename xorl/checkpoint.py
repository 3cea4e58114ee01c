"""Sharded checkpoints with torch.distributed.checkpoint (DCP), saved atomically.

Layout under ``output_dir/checkpoints``:
    step_00000010/        a complete DCP checkpoint (model, optimizer, scheduler, data step, RNG)
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

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

LATEST = "latest"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(models, optimizers) -> tuple[dict, dict]:
    model_sd, optim_sd = {}, {}
    for model, optim in zip(models, optimizers):
        model_sd.update(get_model_state_dict(model, options=_OPTIONS))
        optim_sd.update(get_optimizer_state_dict(model, optim, options=_OPTIONS))
    return model_sd, optim_sd



def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def latest_checkpoint(output_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    root = checkpoint_root(output_dir)
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    return path if os.path.isdir(path) else None


def save_checkpoint(output_dir: str, step: int, models: list[torch.nn.Module],
                    optimizers: list[torch.optim.Optimizer], extra: dict) -> str:
    """Save model/optimizer shards plus ``extra`` (plain Python state, same on every rank)."""
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
    dcp.load(state, checkpoint_id=path)
    for model, optim in zip(models, optimizers):
        # Each part takes the keys it owns; strict=False because the dicts hold every part's keys.
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optim, state["optim"], options=_OPTIONS)
    return state["extra"]
