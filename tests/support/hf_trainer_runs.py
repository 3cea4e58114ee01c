"""Run several examples/hf trainings in one process (one torchrun launch serves every layout of
its world size): ``python -m tests.support.hf_trainer_runs JOBS.json``, JOBS a list of
{"script": "train_trainer" | "train_trl_sft", "argv": [...], "history": PATH}."""

from __future__ import annotations

import importlib.util
import json
import sys

from tests.support.paths import REPO


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "hf" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(path: str) -> None:
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        _script(job["script"]).main([*job["argv"], "--history", job["history"]])


if __name__ == "__main__":
    main(sys.argv[1])
