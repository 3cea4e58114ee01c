"""The families: model_type -> the file in xorl/models/ that declares it (torch-free).

Adding a family: one file in xorl/models/ declaring ``FAMILY`` (a schema.Family: what its
transformers class hard-codes, its config.json names and weight names) and ``MODEL`` (the
nn.Module class; usually DecoderForCausalLM), plus its line here (and its name in schema.MOE,
schema.DENSE or schema.MLA). The family files are imported when first asked for.
"""

from __future__ import annotations

import importlib

from xorl.models.schema import ALL

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
    "gpt_oss": "xorl.models.gpt_oss",
    "deepseek_v3": "xorl.models.deepseek_v3",
    "deepseek_v2": "xorl.models.deepseek_v2",
}
MODEL_TYPES = tuple(_FAMILY_MODULES)
assert set(MODEL_TYPES) == set(ALL), "schema.ALL and the family table must list the same families"


def family_module(model_type: str):
    """The family's module (its FAMILY and MODEL)."""
    if model_type not in _FAMILY_MODULES:
        raise ValueError(f"model_type={model_type!r} is not supported; use one of {list(MODEL_TYPES)}")
    return importlib.import_module(_FAMILY_MODULES[model_type])


def family(model_type: str):
    """The family's schema.Family declaration."""
    return family_module(model_type).FAMILY
