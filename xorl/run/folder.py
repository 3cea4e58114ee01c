"""The run folder (``train.output_dir``): what xorl writes there, and reading it back without torch.

    output_dir/
        config.yaml          the resolved config of the latest start (what this run trains with)
        metrics.jsonl        one row per logged step, each step once across resumes
        tensorboard/, wandb/ train.tensorboard, train.wandb_project (xorl/observability/sinks.py)
        profile/, memory_snapshot/   train.profile_steps, train.memory_snapshot_step (xorl/observability/profiling.py)
        hf/                  train.export_hf
        checkpoints/latest, checkpoints/step_N/   (xorl/checkpoint/state.py)
            run_config.yaml      the config the checkpoint was trained with (checked on resume)
            trainer_state.json   step, sequences consumed, training time, global batch
            manifest.json        every file's size, so a damaged checkpoint is named before loading

Why torch-free: the launcher and every rank read this before any process group starts, so a run
that cannot resume is refused in a second with the file named.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import yaml

from xorl.config.errors import ConfigError

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"  # xorl-plot-metrics' default output
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
RUN_CONFIG_NAME = "run_config.yaml"
TRAINER_STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"  # xorl/run/lock.py
DISCARDED_DIR = "discarded"  # checkpoints moved aside by train.discard_later
TENSORBOARD_DIR, WANDB_DIR = "tensorboard", "wandb"
PROFILE_DIR, MEMORY_SNAPSHOT_DIR = "profile", "memory_snapshot"
# a LoRA run's adapter in peft's format (xorl/checkpoint/peft_adapter.py), written as adapter.partial
ADAPTER_DIR = "adapter"
# Everything xorl may write into an output_dir; overwrite_output_dir removes only these.
# What xorl writes into output_dir (export: hf, written as hf.partial, the previous one moved aside).
XORL_ENTRIES = frozenset({CONFIG_NAME, METRICS_NAME, PLOT_NAME, CHECKPOINTS_DIR, TENSORBOARD_DIR, WANDB_DIR,
                          PROFILE_DIR, MEMORY_SNAPSHOT_DIR, "hf", "hf.partial", "hf.old", "startup.json",
                          "export.json", ADAPTER_DIR, ADAPTER_DIR + ".partial", ADAPTER_DIR + ".old"})


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS_DIR)


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


def step_folders(output_dir: str) -> list[str]:
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))


def entries(output_dir: str) -> list[str]:
    """What the folder holds (empty when it does not exist), less the run lock (xorl/run/lock.py),
    which stays after a run ends and belongs to whichever run holds the folder."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir) if name != LOCK_NAME)


def is_inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def clear_output_dir(output_dir: str) -> None:
    """Remove what an earlier run wrote (overwrite_output_dir; preflight made sure nothing else is there)."""
    for name in entries(output_dir):
        if name in XORL_ENTRIES:
            path = os.path.join(output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# -- a checkpoint's plain files ------------------------------------------------------------
def _manifest(path: str) -> dict[str, dict[str, int]]:
    """{file: {"bytes": n, "crc32": c}}; an older manifest held sizes alone ({file: n})."""
    with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
        raw = json.load(f)
    return {name: entry if isinstance(entry, dict) else {"bytes": entry} for name, entry in raw.items()}


def checkpoint_bytes(path: str) -> int | None:
    """The checkpoint's size from its manifest (None when it has none)."""
    try:
        return sum(int(entry["bytes"]) for entry in _manifest(path).values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_hint(path: str) -> str:
    """How to go on when checkpoint ``path`` cannot be used: the newest earlier one of its folder, with
    ``--train.discard_later=true`` (the refused one and any later are moved aside, never deleted)."""
    root = os.path.dirname(os.path.normpath(path))
    name = os.path.basename(os.path.normpath(path))
    earlier = [n for n in (sorted(os.listdir(root)) if os.path.isdir(root) else [])
               if n.startswith("step_") and not n.endswith(".tmp") and n < name]
    if not earlier:
        return "resume from another checkpoint with --train.resume=PATH (this run's folder holds no earlier one)"
    previous = os.path.join(root, earlier[-1])
    return (f"resume from the previous one with --train.resume={previous} --train.discard_later=true (which moves "
            f"{name} and any later checkpoint aside into {os.path.join(root, DISCARDED_DIR)}/, deleting nothing)")


def checkpoint_problems(path: str) -> list[str]:
    """A missing, shortened or damaged file of checkpoint ``path``, named (from its manifest). The
    small files' CRC-32 is checked here; the shards' at load, split over the ranks (xorl/checkpoint/state.py)."""
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        return [f"checkpoint {path} has no {MANIFEST_NAME}: it was not completely written (or by an older xorl); "
                + resume_hint(path)]
    try:
        entries = _manifest(path)
    except (OSError, ValueError, AttributeError) as e:
        return [f"checkpoint file {manifest} is unreadable ({e}); {resume_hint(path)}"]
    problems = []
    for name, entry in entries.items():
        file = os.path.join(path, name)
        size = entry.get("bytes")
        if not os.path.isfile(file):
            problems.append(f"checkpoint file {file} is missing")
        elif os.path.getsize(file) != size:
            problems.append(f"checkpoint file {file} has {os.path.getsize(file)} bytes, {size} were written")
        elif "crc32" in entry and not name.endswith(".distcp") and _crc32(file) != entry["crc32"]:
            problems.append(f"checkpoint file {file} is damaged: its CRC-32 differs from the one written")
    if problems:
        problems.append(f"checkpoint {path} is damaged; {resume_hint(path)}")
    return problems


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


# -- rank 0, once the run holds the folder (xorl/trainer/trainer.py) -------------------------------
def tidy_checkpoints(output_dir: str, discard_after: str | None) -> list[str]:
    """Rank 0 at start-up: the checkpoints after ``discard_after`` moved aside, unfinished saves
    removed; a line for each thing done."""
    lines = [f"train.discard_later: moved {moved}" for moved in
             (discard_later(output_dir, discard_after) if discard_after else [])]
    stale = remove_stale_tmp(output_dir)
    if stale:
        lines.append(f"removed {', '.join(stale)} from {checkpoint_root(output_dir)}: saves that did not finish "
                     "(a crash, a full disk)")
    return lines


def remove_stale_tmp(output_dir: str) -> list[str]:
    """Remove ``step_N.tmp`` folders: saves that did not finish (a crash, a full disk); their names."""
    root = checkpoint_root(output_dir)
    stale = sorted(n for n in os.listdir(root) if n.startswith("step_") and n.endswith(".tmp")) \
        if os.path.isdir(root) else []
    for name in stale:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return stale


def discard_later(output_dir: str, checkpoint: str) -> list[str]:
    """Move the checkpoints after ``checkpoint`` into checkpoints/discarded/ and point ``latest`` at it."""
    root = checkpoint_root(output_dir)
    name = os.path.basename(os.path.normpath(checkpoint))
    later = [n for n in step_folders(output_dir) if n > name]
    aside = os.path.join(root, DISCARDED_DIR)
    os.makedirs(aside, exist_ok=True)
    moved = []
    for n in later:
        target = os.path.join(aside, n)
        suffix = 1
        while os.path.exists(target):  # discarded twice: keep both
            target, suffix = os.path.join(aside, f"{n}.{suffix}"), suffix + 1
        os.rename(os.path.join(root, n), target)
        moved.append(target)
    write_text_atomic(os.path.join(root, LATEST), name + "\n")
    return moved


def read_checkpoint_files(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config dict the checkpoint was trained with, its trainer state); errors name the file."""
    config_file, state_file = os.path.join(path, RUN_CONFIG_NAME), os.path.join(path, TRAINER_STATE_NAME)
    try:
        with open(config_file, encoding="utf-8") as f:
            stored = yaml.safe_load(f)
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint file {e.filename}: {e.strerror}") from None
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"checkpoint {path}: a damaged {RUN_CONFIG_NAME} or {TRAINER_STATE_NAME}: {e}") from None
    if not isinstance(stored, dict) or not isinstance(state, dict):
        raise ConfigError(f"checkpoint {path}: {RUN_CONFIG_NAME} and {TRAINER_STATE_NAME} must hold mappings")
    return stored, state
