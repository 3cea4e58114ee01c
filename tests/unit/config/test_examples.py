"""Every example config loads and passes every validity rule at the world size it was written for."""

import glob
import os
import re

import pytest

from tests.support.paths import REPO_ROOT
from xorl.cli.train import DEFAULT_CONFIG
from xorl.config import load_config

EXAMPLES = sorted(glob.glob(os.path.join(REPO_ROOT, "examples", "*.yaml")))


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


# Every way of splitting a model, and each model family, has an example at a valid world size.
RECOMMENDED = {
    "FSDP sharding": lambda c: c.train.data_parallel_shard_size > 1,
    "tensor parallel": lambda c: c.train.tensor_parallel_size > 1,
    "sequence parallel": lambda c: c.train.sequence_parallel,
    "pipeline parallel": lambda c: c.train.pipeline_parallel_size > 1,
    "ring attention": lambda c: c.train.ringattn_parallel_size > 1,
    "Ulysses": lambda c: c.train.ulysses_parallel_size > 1,
    "expert parallel": lambda c: c.train.expert_parallel_size > 1,
    "Llama": lambda c: c.model.model_type == "llama",
    "Qwen3-MoE": lambda c: c.model.model_type == "qwen3_moe",
    "Llama-3.1 RoPE scaling": lambda c: (c.model.rope_scaling or {}).get("rope_type") == "llama3",
    "Qwen3 dense": lambda c: c.model.model_type == "qwen3",
    "Mixtral": lambda c: c.model.model_type == "mixtral",
    "GLM-4.5": lambda c: c.model.model_type == "glm4_moe",
    "DeepSeek-V3": lambda c: c.model.model_type == "deepseek_v3",
}


def test_examples_exist_for_the_recommended_layouts():
    configs = [load_config(path, []).validate(_world_size(path)) for path in EXAMPLES]
    missing = [what for what, uses in RECOMMENDED.items() if not any(uses(c) for c in configs)]
    assert not missing, f"no valid example uses: {missing}"


def test_default_config_is_valid_on_four_ranks():
    load_config(DEFAULT_CONFIG, []).validate(4)
