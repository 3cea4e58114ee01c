"""Every example config loads and passes every validity rule at the world size it was written for."""

import glob
import os
import re

import pytest

from xorl.cli.train import DEFAULT_CONFIG
from xorl.config import load_config

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.yaml")))


def _world_size(path: str) -> int:
    match = re.search(r"^# world_size: (\d+)$", open(path).read(), re.M)
    assert match, f"{path} must state '# world_size: N'"
    return int(match.group(1))


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_is_valid_at_its_world_size(path):
    config = load_config(path, [])
    config.validate(_world_size(path))
    with pytest.raises(ValueError):  # and refused at a world size it does not fit
        config.validate(_world_size(path) * 3)


def test_examples_exist_for_the_recommended_layouts():
    assert len(EXAMPLES) >= 6


def test_default_config_is_valid_on_four_ranks():
    load_config(DEFAULT_CONFIG, []).validate(4)
