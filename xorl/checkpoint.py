"""Sharded checkpoints with torch.distributed.checkpoint (DCP), saved atomically.

Layout under ``output_dir/checkpoints``:
    step_00000010/        a complete DCP checkpoint (model, optimizer, scheduler, data step, RNG),
                          plus the trainer's plain files (run_config.yaml, trainer_state.json,
                          model_config.json) and manifest.json: every file's size, so a damaged
                          folder is named before loading
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from xorl.run_dir import LATEST, MANIFEST_NAME, checkpoint_root, latest_checkpoint  # noqa: F401 - re-exported

MODEL_CONFIG = "model_config.json"  # the model section as JSON: xorl-export needs nothing else
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


def _paths(output_dir: str, step: int) -> tuple[str, str, str, str]:
    root = checkpoint_root(output_dir)
    name = f"step_{step:08d}"
    return root, name, os.path.join(root, name), os.path.join(root, name + ".tmp")


def _prepare(root: str, tmp: str) -> None:
    """Rank 0: an empty ``step_N.tmp`` (a crashed earlier attempt's files removed)."""
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _publish(root: str, tmp: str, final: str, name: str, files: dict[str, str]) -> None:
    """Rank 0, once every rank wrote its part: the plain files and the manifest, ``step_N.tmp`` ->
    ``step_N``, then ``latest``."""
    _write_files(tmp, files)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))


def save_checkpoint(output_dir: str, step: int, models: list[torch.nn.Module],
                    optimizers: list[torch.optim.Optimizer], extra: dict,
                    files: dict[str, str] | None = None) -> str:
    """Save model/optimizer shards plus ``extra`` (plain Python state, same on every rank) and
    ``files`` (name -> text, written by rank 0 into the folder before it becomes visible); blocking."""
    root, name, final, tmp = _paths(output_dir, step)
    if _is_rank0():
        _prepare(root, tmp)
    _barrier()
    model_sd, optim_sd = _state(models, optimizers)
    dcp.save({"extra": extra, "model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    _barrier()
    if _is_rank0():
        _publish(root, tmp, final, name, files or {})
    _barrier()
    return final


class Checkpointer:
    """Asynchronous, atomic checkpoints of one run (see the module docstring); every rank makes one."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xorl-checkpoint")
        self._pending: Future | None = None

    def save(self, step: int, models, optimizers, extra: dict, files: dict[str, str] | None = None,
             blocking: bool = False) -> str:
        """Start saving; returns the path the checkpoint will have once ``wait`` (or the next save) ends.

        ``blocking``: write now, without the staging copy (the last step of a run, or before an
        export: nothing would overlap it, and the copy costs host memory of the rank's whole state).
        ``files``: as in ``save_checkpoint``, written once every rank's shards are.
        """
        self.wait()
        root, name, final, tmp = _paths(self.output_dir, step)
        if _is_rank0():
            _prepare(root, tmp)
        self._barrier()
        model_sd, optim_sd = _state(models, optimizers)
        state = {"extra": extra, "model": model_sd, "optim": optim_sd}
        if blocking:
            done: Future = Future()
            try:
                done.set_result(dcp.save(state, checkpoint_id=tmp, process_group=self.group))
            except Exception as err:  # noqa: BLE001 - reported once every rank answered (_finish)
                done.set_exception(err)
            return self._finish(done, root, tmp, final, name, files or {})
        # Returns once the state is copied (staged); the write runs in DCP's background thread.
        upload = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
        self._pending = self._background.submit(self._finish, upload, root, tmp, final, name, files or {})
        return final

    def wait(self) -> str | None:
        """Block until the last save is complete and ``latest`` names it; re-raise its failure here."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _finish(self, upload: Future, root: str, tmp: str, final: str, name: str, files: dict[str, str]) -> str:
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
            _publish(root, tmp, final, name, files)
        self._barrier()
        return final

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


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
