"""The model section's rules (xorl/config/rules/model.py) that refuse what the trainer cannot run."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.parity_runs import tiny_config
from xorl.config.errors import ConfigError
from xorl.config.validate import validate_config


def test_layouts_the_trainer_cannot_run_are_refused_up_front(tmp_path):
    if importlib.util.find_spec("flash_attn") is None:
        config = tiny_config(str(tmp_path))
        config.model.attn_implementation = "flash_attn"
        with pytest.raises(ConfigError, match="flash-attn package is not installed"):
            validate_config(config, 1)
