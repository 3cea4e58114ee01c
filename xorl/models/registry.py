"""build_model / to_hf_config_dict: the entry points the trainer uses (the families are listed in
xorl/models/families.py)."""

from __future__ import annotations

from typing import Any

from xorl.models.families import MODEL_TYPES, family, family_module

__all__ = ["MODEL_TYPES", "build_model", "family", "to_hf_config_dict"]


def build_model(model_config: Any, fp8: str = "none"):
    """Build the model named by ``model_config.model_type`` on the current default device.

    Under ``with torch.device("meta"):`` nothing is allocated; materialise later with
    ``model.to_empty(device=...)`` then ``model.init_weights()``. On a real device the weights are
    initialised here (normal(0, initializer_range), norms 1). ``fp8``: the projections' FP8
    recipe (train.fp8; xorl/nn/linear.py), fixed at construction.
    """
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(model_config)
    model = family_module(spec.model_type).MODEL(model_config, fp8=fp8)
    if next(model.parameters()).device.type != "meta":
        model.init_weights()
    return model


def to_hf_config_dict(model_config: Any, dtype: Any = None) -> dict[str, Any]:
    """A config.json dict that the family's transformers class loads."""
    from xorl.models.hf_config import fields_to_hf
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(model_config)
    config = fields_to_hf(spec, family(spec.model_type))
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    return config
