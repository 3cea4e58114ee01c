"""build_model(config) and to_hf_config_dict(config): the entry points the trainer uses."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from xorl.models import llama, qwen3_moe
from xorl.models.spec import ModelSpec

_FAMILIES = {
    "llama": (llama.LlamaForCausalLM, llama.hf_config_dict),
    "qwen3_moe": (qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.hf_config_dict),
}


def build_model(model_config: Any, fp8: str = "none") -> nn.Module:
    """Build the model named by ``model_config.model_type`` on the current default device.

    Under ``with torch.device("meta"):`` nothing is allocated; materialise later with
    ``model.to_empty(device=...)`` then ``model.init_weights()``. On a real device the weights are
    initialised here (normal(0, initializer_range), norms 1). ``fp8``: the projections' FP8
    recipe (train.fp8; xorl/nn/linear.py), fixed at construction.
    """
    spec = ModelSpec.from_config(model_config)
    model_cls, _ = _FAMILIES[spec.model_type]
    model = model_cls(model_config, fp8=fp8)
    if next(model.parameters()).device.type != "meta":
        model.init_weights()
    return model


def to_hf_config_dict(model_config: Any, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A config.json dict that transformers loads (LlamaForCausalLM / Qwen3MoeForCausalLM)."""
    spec = ModelSpec.from_config(model_config)
    _, hf_config = _FAMILIES[spec.model_type]
    config = hf_config(spec)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    return config
