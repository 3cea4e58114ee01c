"""xorl.hf.distributed_config and xorl_tp_plan (xorl/hf/distributed.py), without a process group: the
tp_plan override names xorl's styles exactly where the model's own plan (read from a stock model built
on the meta device) has transformers' colwise / rowwise, and nothing else; the DistributedConfig fields
for each layout; every bad size refused before anything is built, the message naming the number and
the fix. The layouts themselves train as one process in tests/multirank/test_hf_expert_tensor_parallel.py
and tests/e2e/test_hf_trainer_parallel.py."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import xorl.hf  # noqa: E402
from tests.unit.models.test_families import FAMILIES, SMALL  # noqa: E402


def _config(name, **overrides):
    _, config_name, fields = FAMILIES[name]
    return getattr(transformers, config_name)(**{**SMALL, **fields, **overrides})


@pytest.mark.parametrize("name", ["llama3.1-rope-llama3", "qwen3_moe", "mixtral"])
def test_the_tp_plan_override_names_xorl_styles_where_the_stock_plan_has_colwise_or_rowwise(name):
    config = _config(name)
    with torch.device("meta"):
        stock = getattr(transformers, FAMILIES[name][0])(config).tp_plan
    expected = {k: {"colwise": "xorl_colwise", "rowwise": "xorl_rowwise"}[v] for k, v in stock.items()
                if v in ("colwise", "rowwise")}
    plan = xorl.hf.xorl_tp_plan(config)
    assert plan == expected and {k.rsplit(".", 1)[1] for k in plan} >= {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert stock.keys() - plan.keys()  # the embedding, lm_head (and Qwen3's q/k norms) keep their styles


def test_each_layout_is_transformers_distributed_config_with_xorl_names():
    ep = xorl.hf.distributed_config(_config("qwen3_moe"), ep=2, world_size=4)
    assert isinstance(ep, transformers.distributed.DistributedConfig)
    assert (ep.ep_size, ep.fsdp_size, ep.tp_size, ep.efsdp_size, ep.ep_implementation, ep.tp_plan) == (
        2, 4, 1, 2, "xorl", None)
    tp = xorl.hf.distributed_config(_config("llama3.1-rope-llama3"), tp=2, world_size=2)
    assert (tp.tp_size, tp.fsdp_size, tp.ep_size, tp.ep_implementation) == (2, 1, 1, "auto")
    assert tp.tp_plan == xorl.hf.xorl_tp_plan(_config("llama3.1-rope-llama3"))
    fsdp = xorl.hf.distributed_config(_config("llama3.1-rope-llama3"), world_size=2)
    assert (fsdp.fsdp_size, fsdp.tp_size, fsdp.ep_size, fsdp.tp_plan) == (2, 1, 1, None)


@pytest.mark.parametrize("name,overrides,layout,message", [
    ("mixtral", {}, dict(ep=2, world_size=4), "5 experts do not split over 2 expert-parallel ranks; choose an ep "
     "dividing 5"),
    ("llama3.1-rope-llama3", {}, dict(tp=4, world_size=4), "6 attention heads do not split over 4 TP ranks; "
     "choose a tp dividing 6"),
    ("llama3.1-rope-llama3", dict(num_key_value_heads=3), dict(tp=2, world_size=2), "3 KV heads do not split "
     "over 2 TP ranks; choose a tp dividing 3"),
    ("llama3.1-rope-llama3", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=42),
     dict(tp=4, world_size=4), "42 MLP width (intermediate_size) do not split over 4 TP ranks"),
    ("llama3.1-rope-llama3", {}, dict(tp=2, fsdp=1, world_size=4), "tp x fsdp = 2 ranks, but the world has 4; "
     "choose fsdp = world_size / tp"),
    ("llama3.1-rope-llama3", {}, dict(ep=2, world_size=2), "has no experts to split (a dense model); use ep=1"),
    ("qwen3_moe", {}, dict(ep=2, tp=2, world_size=4), "use tp=1 with ep > 1"),
    ("qwen3_moe", dict(num_experts=8), dict(ep=4, world_size=6), "4 expert-parallel ranks do not divide the 6 "
     "ranks"),
])
def test_bad_sizes_are_refused_up_front_naming_the_fix(name, overrides, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        xorl.hf.distributed_config(_config(name, **overrides), **layout)
