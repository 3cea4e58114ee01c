"""The families, and build_model / to_hf_config_dict, the entry points the trainer uses.

Adding a family: one file in xorl/models/ declaring ``FAMILY`` (a schema.Family: what its
transformers class hard-codes, its config.json names and weight names) and ``MODEL`` (the
nn.Module class; usually DecoderForCausalLM or a subclass choosing the MLP per layer), plus its
line here. The family modules are imported when first asked for (this module imports no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from xorl.models.schema import ALL

# model_type -> module holding FAMILY and MODEL
_FAMILY_MODULES = {
    "llama": "xorl.models.llama",
    "qwen2": "xorl.models.qwen2",
    "qwen3": "xorl.models.qwen3",
    "mistral": "xorl.models.mistral",
    "qwen3_moe": "xorl.models.qwen3_moe",
    "qwen2_moe": "xorl.models.qwen2_moe",
    "mixtral": "xorl.models.mixtral",
    "olmoe": "xorl.models.olmoe",
    "glm4_moe": "xorl.models.glm4_moe",
}
MODEL_TYPES = tuple(_FAMILY_MODULES)
assert set(MODEL_TYPES) == set(ALL), "schema.ALL and the registry must list the same families"


def _module(model_type: str):
    if model_type not in _FAMILY_MODULES:
        raise ValueError(f"model_type={model_type!r} is not supported; use one of {list(MODEL_TYPES)}")
    return importlib.import_module(_FAMILY_MODULES[model_type])


def family(model_type: str):
    """The family's schema.Family declaration."""
    return _module(model_type).FAMILY


def build_model(model_config: Any):
    """Build the model named by ``model_config.model_type`` on the current default device.

    Under ``with torch.device("meta"):`` nothing is allocated; materialise later with
    ``model.to_empty(device=...)`` then ``model.init_weights()``. On a real device the weights are
    initialised here (normal(0, initializer_range), norms 1).
    """
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(model_config)
    model = _module(spec.model_type).MODEL(model_config)
    if next(model.parameters()).device.type != "meta":
        model.init_weights()
    return model


def to_hf_config_dict(model_config: Any, dtype: Any = None) -> dict[str, Any]:
    """A config.json dict that the family's transformers class loads."""
    from xorl.models.schema import fields_to_hf
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(model_config)
    config = fields_to_hf(spec, family(spec.model_type))
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    return config
