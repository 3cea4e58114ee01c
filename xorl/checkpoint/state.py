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
import zlib
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

from xorl.checkpoint.files import file_crc32, is_disk_full, no_space_message, recording_writer
from xorl.run.folder import LATEST, MANIFEST_NAME, checkpoint_bytes, checkpoint_root, latest_checkpoint, resume_hint  # noqa: F401 - re-exported

MODEL_CONFIG = "model_config.json"  # the model section as JSON: xorl-export needs nothing else
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(models, optimizers) -> tuple[dict, dict]:
    model_sd, optim_sd = {}, {}
    for model, optim in zip(models, optimizers):
        model_sd.update(get_model_state_dict(model, options=_OPTIONS))
        optim_sd.update(_tied_head_keys(model, get_optimizer_state_dict(model, optim, options=_OPTIONS), save=True))
    return model_sd, optim_sd


_HEAD, _EMBED = ".lm_head.weight.", ".model.embed_tokens.weight."


def _holds_tied_head_copy(model) -> bool:
    """A pipeline stage whose lm_head is its own copy of a tied embedding (parallel/pipeline_parallel.py)."""
    decoder = getattr(model, "model", None)
    return (bool(getattr(getattr(model, "spec", None), "tie_word_embeddings", False))
            and getattr(model, "lm_head", None) is not None and getattr(decoder, "embed_tokens", 0) is None)


def _tied_head_keys(model, optim_sd: dict, save: bool) -> dict:
    """The optimizer state of a stage's tied lm_head copy under the embedding's names, as one process
    saves a tied weight (once, as model.embed_tokens.weight): so a checkpoint loads on any layout.

    ``save``: rename lm_head's keys to the embedding's; else (load) add lm_head's keys, copied from
    the embedding's (copies: where one rank holds both stages, each optimizer keeps its own tensors).
    """
    if not _holds_tied_head_copy(model):
        return optim_sd
    if save:
        return {_rename(k, _HEAD, _EMBED): v for k, v in optim_sd.items()}
    head = {_rename(k, _EMBED, _HEAD): v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in optim_sd.items() if _rename(k, _EMBED, _HEAD) != k}
    return {**optim_sd, **head}


def _rename(key: str, old: str, new: str) -> str:
    """``state.<old>exp_avg`` -> ``state.<new>exp_avg`` (flattened optimizer keys: section.fqn.field)."""
    section, dot, rest = key.partition(".")
    return f"{section}{new}{rest[len(old) - 1:]}" if dot and ("." + rest).startswith(old) else key


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


def _publish(root: str, tmp: str, final: str, name: str, files: dict[str, str],
             records: dict[str, tuple[int, int]]) -> None:
    """Rank 0, once every rank wrote its part: the plain files and the manifest, ``step_N.tmp`` ->
    ``step_N``, then ``latest`` (a failure part-way: ``_unpublish``)."""
    _write_files(tmp, files, records)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))


def _unpublish(root: str, tmp: str, final: str) -> None:
    """Rank 0, after ``_publish`` failed part-way: the new folder (either name) and pointer go."""
    for folder in (tmp, final):
        shutil.rmtree(folder, ignore_errors=True)
    pointer = os.path.join(root, LATEST + ".tmp")
    if os.path.exists(pointer):
        os.remove(pointer)


def _published(root: str, tmp: str, final: str, name: str, files: dict[str, str],
               records: dict[str, tuple[int, int]], needed: int | None, group) -> None:
    """Rank 0 publishes; every rank learns whether it worked (rank 0's verdict is broadcast, which
    also keeps the others waiting until ``latest`` names the new checkpoint) and raises the same
    CheckpointError if not, so a full disk during the small files is named like one during the shards."""
    if needed is None:  # save_checkpoint measured nothing before: at least the shards just written
        needed = sum(size for _, size in records.values())
    failure: OSError | None = None
    verdict = torch.zeros(3, dtype=torch.float64)  # (failed, disk full, free bytes when it failed)
    if _is_rank0():
        try:
            _publish(root, tmp, final, name, files, records)
        except OSError as err:
            failure = err
            verdict[:] = torch.tensor([1.0, float(is_disk_full(err)), shutil.disk_usage(root).free])
            _unpublish(root, tmp, final)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(verdict, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if verdict[0].item() == 0.0:
        return
    if verdict[1].item() > 0:
        free = int(verdict[2].item())
        raise CheckpointError(
            f"no space left on {root}: {needed} bytes needed, {free} "
            f"free; checkpoint {name} was not written and {_kept(root)}. Free space (or move train.output_dir), "
            "then continue with --train.resume=true") from failure
    reason = f"{failure.strerror or failure} ({failure.filename})" if failure is not None else \
        "rank 0 could not write its files"
    raise CheckpointError(f"checkpoint {name} was not written: {reason}; {_kept(root)}") from failure


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
    writer, fs = recording_writer(tmp)
    dcp.save({"extra": extra, "model": model_sd, "optim": optim_sd}, storage_writer=writer)
    records = _gather_records(fs.records, None)
    _published(root, tmp, final, name, files or {}, records, None, None)
    return final


def _kept(root: str) -> str:
    latest = os.path.join(root, LATEST)
    return f"{latest} still names the previous one" if os.path.isfile(latest) else "no earlier checkpoint exists"


def _gather_records(records: dict, group) -> dict[str, tuple[int, int]]:
    """Every rank's {file: (crc32, size)}, merged (each rank writes its own files); also a barrier."""
    if not dist.is_initialized():
        return dict(records)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, records, group=group)
    return {k: v for part in gathered for k, v in part.items()}


def _state_bytes(state: dict) -> dict[str, int]:
    """Bytes of each tensor of the state at its global shape (a DTensor counts whole, on every rank)."""
    sizes = {}
    for section in ("model", "optim"):
        for key, value in state[section].items():
            if isinstance(value, torch.Tensor):
                sizes[f"{section}/{key}"] = value.numel() * value.element_size()
    return sizes


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
        model_sd, optim_sd = _state(models, optimizers)
        state = {"extra": extra, "model": model_sd, "optim": optim_sd}
        needed = self._check_space(root, tmp, name, state)
        writer, fs = recording_writer(tmp)
        if blocking:
            done: Future = Future()
            try:
                done.set_result(dcp.save(state, storage_writer=writer, process_group=self.group))
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported in _finish, every rank
                # (CheckpointException, DCP's gathered failures, is a BaseException: caught by name)
                done.set_exception(err)
            return self._finish(done, root, tmp, final, name, files or {}, fs, needed)
        # Returns once the state is copied (staged); the write runs in DCP's background thread.
        upload = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        self._pending = self._background.submit(self._finish, upload, root, tmp, final, name, files or {}, fs,
                                                needed)
        return final

    def _check_space(self, root: str, tmp: str, name: str, state: dict) -> int:
        """Before a save starts (async ones too): refuse it on every rank when the disk cannot hold it.

        The size is the previous checkpoint's (its manifest: exact, torch.save's overhead included);
        for the first save, the state's tensors at their global shapes (every rank lists its own;
        pipeline stages hold different ones). Rank 0 measures and broadcasts; the broadcast also
        orders every rank's writes after rank 0 made ``step_N.tmp``.
        """
        previous = latest_checkpoint(self.output_dir) if _is_rank0() else None
        known = torch.tensor([float(checkpoint_bytes(previous) or -1) if previous else -1.0], dtype=torch.float64)
        if self.group is not None:  # rank 0's view decides (another node's may lag on a network filesystem)
            dist.broadcast(known, src=0, group=self.group)
        needed = int(known.item()) if known.item() >= 0 else None
        if needed is None:
            sizes = _state_bytes(state)
            if self.group is not None:
                gathered: list = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(gathered, sizes, group=self.group)
                sizes = {k: v for part in gathered for k, v in part.items()}
            needed = sum(sizes.values())
        verdict = torch.zeros(2, dtype=torch.float64)  # (needed, free): exact below 2**53 bytes
        if _is_rank0():
            try:
                _prepare(root, tmp)
                free = shutil.disk_usage(root).free
            except OSError as err:  # a disk too full for even the empty folder
                if not is_disk_full(err):
                    raise
                free = 0
            verdict[0], verdict[1] = needed, free
        if self.group is not None:
            dist.broadcast(verdict, src=0, group=self.group)
        needed, free = int(verdict[0]), int(verdict[1])
        if free < needed:
            if _is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"no space left on {root}: {needed} bytes needed, {free} free; checkpoint {name} was not started "
                f"and {_kept(root)}. Free space (or move train.output_dir), then continue with --train.resume=true")
        return needed

    def wait(self) -> str | None:
        """Block until the last save is complete and ``latest`` names it; re-raise its failure here."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _finish(self, upload: Future, root: str, tmp: str, final: str, name: str, files: dict[str, str],
                fs, needed: int) -> str:
        error = None
        try:
            upload.result()
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported below, once every rank answered
            error = err
        full = fs.full is not None or is_disk_full(error)
        # (ok, disk full): publish only what every rank wrote; any rank's ENOSPC names the disk
        verdict = torch.tensor([0.0 if error else 1.0, 1.0 if full else 0.0])
        if self.group is not None:
            dist.all_reduce(verdict[:1], op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(verdict[1:], op=dist.ReduceOp.MAX, group=self.group)
        if verdict[0].item() < 1.0:
            # the free space as the write left it, measured on every rank before rank 0 removes the partial folder
            full_message = no_space_message(root, needed) if verdict[1].item() > 0 else ""
            self._barrier()  # every rank stopped writing (and measured) before rank 0 removes the partial folder
            if verdict[1].item() > 0:
                if _is_rank0():
                    shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"{full_message}; checkpoint {name} was not written and {_kept(root)}. Free "
                    "space (or move train.output_dir), then continue with --train.resume=true") from error
            raise RuntimeError(
                f"checkpoint {name} was not written completely ({error or 'another rank failed'}); "
                f"{os.path.join(root, LATEST)} still names the previous checkpoint"
            ) from error
        records = _gather_records(fs.records, self.group)
        _published(root, tmp, final, name, files, records, needed, self.group)
        return final

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _write_files(folder: str, files: dict[str, str], records: dict[str, tuple[int, int]]) -> None:
    """The plain files, then the manifest: every file's size and CRC-32 (computed as it was written:
    ``records`` for DCP's files, the encoded text here). Written last: it vouches for the rest."""
    records = dict(records)
    for name, text in files.items():
        data = text.encode("utf-8")
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        records[name] = (zlib.crc32(data), len(data))
    entries = {}
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            size = os.path.getsize(os.path.join(root, name))
            if rel in records and records[rel][1] != size:
                raise RuntimeError(f"checkpoint file {os.path.join(root, name)} has {size} bytes on disk, "
                                   f"{records[rel][1]} were written")
            entries[rel] = {"bytes": size, "crc32": records[rel][0]} if rel in records else {"bytes": size}
    with open(os.path.join(folder, MANIFEST_NAME), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(entries.items())), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _verify_checksums(path: str) -> None:
    """Collective: the shard files' CRC-32 against the manifest, each file read by one rank.

    Why split: a 70B checkpoint with its optimizer state is near a terabyte; each rank reads
    1/world of the files (in parallel, once), and every rank learns every mismatch. The small files
    were checked before start-up (xorl/run/folder.py checkpoint_problems).
    """
    with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
        manifest = json.load(f)
    files = sorted(name for name, entry in manifest.items()
                   if isinstance(entry, dict) and "crc32" in entry and name.endswith(".distcp"))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad = []
    for name in files[rank::world]:
        file = os.path.join(path, name)
        try:
            crc = file_crc32(file)
        except OSError as e:
            bad.append(f"{e.strerror} (reading {file})")
            continue
        if crc != manifest[name]["crc32"]:
            bad.append(f"damaged bytes: CRC-32 {crc:08x}, {manifest[name]['crc32']:08x} was written (reading {file})")
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, bad)
        bad = [line for part in gathered for line in part]
    if bad:
        raise CheckpointError(f"cannot load checkpoint {path}: " + "; ".join(bad) + f"; {resume_hint(path)}")


def _check_metadata(path: str) -> None:
    """DCP's index of the shards, read first so a damaged one is named (DCP would log a fallback)."""
    metadata = os.path.join(path, ".metadata")
    try:
        dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling can fail in many ways; all mean "damaged"
        raise CheckpointError(f"cannot load checkpoint {path}: {metadata} is unreadable ({type(e).__name__}: "
                              f"{e}); {resume_hint(path)}") from e


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
    _verify_checksums(path)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException gathers every rank's failure
        lines = [line for line in str(e).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {reason} (reading {_shard_files(path)}); "
                              f"{resume_hint(path)}") from e
    for model, optim in zip(models, optimizers):
        # Each part takes the keys it owns; strict=False because the dicts hold every part's keys.
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optim, _tied_head_keys(model, state["optim"], save=False), options=_OPTIONS)
    return state["extra"]
