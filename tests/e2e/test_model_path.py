"""model.model_path's weight files (xorl/config/model_path.py) through the real `xorl-train`: a damaged
file is one message before start."""

from __future__ import annotations

import os

import pytest

from tests.support.cli_runs import write_config, xorl_train
from tests.support.fault_runs import hf_llama_folder


@pytest.mark.slow
def test_weight_file_faults_are_one_message_before_start(tmp_path):
    hf_llama_folder(str(tmp_path / "llama"), layers=2)
    single = tmp_path / "llama" / "model.safetensors"
    os.truncate(single, single.stat().st_size // 2)
    config = write_config(tmp_path, "out", max_steps=1)
    run = xorl_train(config, "--model.model_path=llama", cwd=tmp_path)
    assert run.code == 2 and "Traceback" not in run.text, run.text
    assert run.err.count("llama/model.safetensors has") == 1 and "cut short" in run.err
    assert not (tmp_path / "out").exists()  # refused before anything started
