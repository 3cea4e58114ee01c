"""The run folder (``train.output_dir``): what xorl writes there, and reading it back without torch.

    output_dir/
        config.yaml          the resolved config of the latest start (what this run trains with)
        metrics.jsonl        one row per logged step, each step once across resumes
        tensorboard/, hf/    optional
        checkpoints/latest, checkpoints/step_N/   (xorl/checkpoint.py)
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
from typing import Any

import yaml

from xorl.config_error import ConfigError

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"  # xorl-plot-metrics' default output
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
RUN_CONFIG_NAME = "run_config.yaml"
TRAINER_STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "manifest.json"
# Everything xorl may write into an output_dir; overwrite_output_dir removes only these.
# What xorl writes into output_dir (export: hf, written as hf.partial, the previous one moved aside).
XORL_ENTRIES = frozenset({CONFIG_NAME, METRICS_NAME, PLOT_NAME, CHECKPOINTS_DIR, "tensorboard", "hf", "hf.partial",
                          "hf.old", "startup.json", "export.json"})


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
    """What the folder holds (empty when it does not exist)."""
    return sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []


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
def checkpoint_problems(path: str) -> list[str]:
    """A missing or shortened file of checkpoint ``path``, named (from its manifest)."""
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        return [f"checkpoint {path} has no {MANIFEST_NAME}: it was not completely written (or by an older xorl); "
                "resume from another checkpoint with --train.resume=PATH"]
    try:
        with open(manifest, encoding="utf-8") as f:
            sizes = json.load(f)
    except (OSError, ValueError) as e:
        return [f"checkpoint file {manifest} is unreadable ({e}); resume from another checkpoint"]
    problems = []
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"checkpoint file {file} is missing")
        elif os.path.getsize(file) != size:
            problems.append(f"checkpoint file {file} has {os.path.getsize(file)} bytes, {size} were written")
    if problems:
        problems.append(f"checkpoint {path} is damaged; resume from another one with --train.resume=PATH")
    return problems


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
