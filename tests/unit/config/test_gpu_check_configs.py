"""scripts/gpu_check.py's runs are configs like any user's: each one the rules accept (checked here on
CPU, so a GPU session does not find out at its first call that the smoke model is refused)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.support.paths import REPO_ROOT
from xorl.config import validate_config

ROOT = REPO_ROOT


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs():
    gpu_check = _gpu_check()
    for model in ("dense", "moe"):
        yield model, ()  # smoke, sync, compile's eager run
        yield model, ("--train.compile=true",)
        for _, extra in gpu_check.fp8_recipes(model):
            yield model, extra


@pytest.mark.parametrize("model, extra", list(_runs()), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_gpu_check_run_is_a_valid_config(model, extra, tmp_path):
    config = _gpu_check()._config(model, 20, str(tmp_path / "out"), extra)
    validate_config(config, 1)
    assert config.data.seq_len == 4096 and config.train.dtype == "bfloat16"
