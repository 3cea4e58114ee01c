"""A non-finite loss explained (xorl/trainer/nonfinite.py) through the real `xorl-train`: a NaN weight in
the model folder is named once."""

from __future__ import annotations

import pytest

from tests.support.cli_runs import write_config, xorl_train
from tests.support.fault_runs import hf_llama_folder


@pytest.mark.slow
def test_a_nan_weight_from_the_command_line(tmp_path):
    hf_llama_folder(str(tmp_path / "llama"), nan_in="model.layers.1.self_attn.q_proj.weight", layers=2)
    config = write_config(tmp_path, "out", max_steps=2)
    run = xorl_train(config, "--model.model_path=llama", cwd=tmp_path)
    assert run.code == 1 and "Traceback" not in run.text, run.text
    assert run.err.count("model.layers.1.self_attn.q_proj.weight holds NaN or inf values") == 1, run.err
    assert "last good checkpoint" not in run.text
