"""Sharded checkpoints with torch.distributed.checkpoint (DCP), saved atomically.

Layout under ``output_dir/checkpoints``:
    step_00000010/        a complete DCP checkpoint (model, optimizer, scheduler, data step, RNG)
    latest                a one-line file naming the newest complete checkpoint

Why atomic: a save goes to ``step_N.tmp`` first; only after every rank finished writing does
rank 0 rename it to ``step_N`` and then replace ``latest`` with ``os.replace`` (atomic on POSIX).
A crash at any point leaves the previous ``latest`` and its folder untouched.

Why asynchronous (``Checkpointer``, what the trainer uses): DCP's ``async_save`` copies this
rank's shards (staging, the one pause training sees) and writes them from a background thread, so
steps go on while a 70B checkpoint reaches the disk. The rename to ``step_N`` and the move of
``latest`` also happen in the background, after every rank reported its write done; the next save
(or the end of training) waits for the previous one. The writes and their collectives use a gloo
group of their own, so they never interleave with the training step's collectives (and NCCL
training gets the CPU group that async saves need).

Each checkpoint also holds ``model_config.json`` (the ``model:`` section), so ``xorl-export``
converts it to a Hugging Face folder without the run's config.

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
from concurrent.futures import Future, ThreadPoolExecutor

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
MODEL_CONFIG = "model_config.json"
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


def _paths(output_dir: str, step: int) -> tuple[str, str, str, str]:
    root = checkpoint_root(output_dir)
    name = f"step_{step:08d}"
    return root, name, os.path.join(root, name), os.path.join(root, name + ".tmp")


def _prepare(root: str, tmp: str, model_config: dict | None) -> None:
    """Rank 0: an empty ``step_N.tmp`` (a crashed earlier attempt's files removed)."""
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if model_config is not None:
        with open(os.path.join(tmp, MODEL_CONFIG), "w", encoding="utf-8") as f:
            json.dump(model_config, f, indent=2)


def _publish(root: str, tmp: str, final: str, name: str) -> None:
    """Rank 0, once every rank wrote its part: ``step_N.tmp`` -> ``step_N``, then ``latest``."""
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))


def save_checkpoint(output_dir: str, step: int, models: list[torch.nn.Module],
                    optimizers: list[torch.optim.Optimizer], extra: dict, model_config: dict | None = None) -> str:
    """Save model/optimizer shards plus ``extra`` (plain Python state, same on every rank); blocking."""
    root, name, final, tmp = _paths(output_dir, step)
    if _is_rank0():
        _prepare(root, tmp, model_config)
    _barrier()
    model_sd, optim_sd = _state(models, optimizers)
    dcp.save({"extra": extra, "model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    _barrier()
    if _is_rank0():
        _publish(root, tmp, final, name)
    _barrier()
    return final


class Checkpointer:
    """Asynchronous, atomic checkpoints of one run (see the module docstring); every rank makes one."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xorl-checkpoint")
        self._pending: Future | None = None

    def save(self, step: int, models, optimizers, extra: dict, model_config: dict | None = None,
             blocking: bool = False) -> str:
        """Start saving; returns the path the checkpoint will have once ``wait`` (or the next save) ends.

        ``blocking``: write now, without the staging copy (the last step of a run, or before an
        export: nothing would overlap it, and the copy costs host memory of the rank's whole state).
        """
        self.wait()
        root, name, final, tmp = _paths(self.output_dir, step)
        if _is_rank0():
            _prepare(root, tmp, model_config)
        self._barrier()
        model_sd, optim_sd = _state(models, optimizers)
        state = {"extra": extra, "model": model_sd, "optim": optim_sd}
        if blocking:
            done: Future = Future()
            try:
                done.set_result(dcp.save(state, checkpoint_id=tmp, process_group=self.group))
            except Exception as err:  # noqa: BLE001 - reported once every rank answered (_finish)
                done.set_exception(err)
            return self._finish(done, root, tmp, final, name)
        # Returns once the state is copied (staged); the write runs in DCP's background thread.
        upload = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
        self._pending = self._background.submit(self._finish, upload, root, tmp, final, name)
        return final

    def wait(self) -> str | None:
        """Block until the last save is complete and ``latest`` names it; re-raise its failure here."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _finish(self, upload: Future, root: str, tmp: str, final: str, name: str) -> str:
        error = None
        try:
            upload.result()
        except Exception as err:  # noqa: BLE001 - reported below, once every rank has answered
            error = err
        ok = torch.tensor([0.0 if error else 1.0])
        if self.group is not None:  # publish only what every rank wrote
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if ok.item() < 1.0:
            raise RuntimeError(
                f"checkpoint {name} was not written completely ({error or 'another rank failed'}); "
                f"{os.path.join(root, LATEST)} still names the previous checkpoint"
            ) from error
        if _is_rank0():
            _publish(root, tmp, final, name)
        self._barrier()
        return final

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


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
