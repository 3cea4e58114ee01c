"""What xorl-plan plans for: an xorl YAML, a local Hugging Face folder, or a bare parameter count.

- ``run.yaml``: the config as ``xorl-train`` would load it (its layout is the one ``--layout`` with
  no value evaluates).
- ``/models/Llama-3-70B/``: the architecture fields of its ``config.json`` (the Hugging Face names
  are xorl's ModelConfig names, see xorl/config.py); ``model_path`` points at the folder when it holds
  weights (*.safetensors; else it stays unset: seeded initialisation, and a note says so) and a
  ``tokenizer.json`` next to it becomes ``data.tokenizer``, so ``--write-config`` starts from those
  weights. Only config.json and the file names are read: no weights, no network.
- ``70B`` / ``7.5e9``: a parameter count, for the back-of-envelope state arithmetic of published
  tables (parameters split evenly over TP x PP [x the FSDP shards]); no shapes, so no activations,
  step time or ranking.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields

from xorl.config import Config, ModelConfig, load_config, set_field
from xorl.config_error import ConfigError

# config.json fields that are not xorl ModelConfig fields but change nothing the planner counts.
_IGNORED_HF_FIELDS = ("rope_scaling",)
_HF_ALIASES = {"num_local_experts": "num_experts"}  # transformers v5's Qwen3MoeConfig
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kKmMbBtT]?)\s*$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


@dataclass
class ModelSource:
    """``config`` for a YAML or HF folder; ``num_params`` alone for a bare parameter count."""

    label: str
    config: Config | None = None
    num_params: int | None = None
    yaml_layout: bool = False  # the config's train section came from the user (a YAML)
    notes: tuple[str, ...] = ()


def read_model_source(model: str) -> ModelSource:
    """Refuse anything else with one ConfigError naming MODEL and what it accepts."""
    count = _COUNT.match(model)
    if count and not os.path.exists(model):
        return ModelSource(label=model, num_params=int(float(count[1]) * _UNITS[count[2].lower()]))
    if os.path.isdir(model):
        return _from_hf_folder(model)
    if os.path.isfile(model) and model.endswith((".yaml", ".yml")):
        return ModelSource(label=model, config=load_config(model), yaml_layout=True)
    raise ConfigError(
        f"MODEL={model!r} is neither an xorl YAML (.yaml), a local Hugging Face folder with config.json, "
        "nor a parameter count like 70B; pass one of those"
    )


def _from_hf_folder(folder: str) -> ModelSource:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except OSError as e:
        raise ConfigError(f"MODEL={folder!r}: cannot read {path} ({e.strerror}); point at a HF model folder") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"MODEL={folder!r}: {path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"MODEL={folder!r}: {path} must hold a JSON object of config fields")
    hf = dict(hf)
    model_type = hf.get("model_type")
    if model_type not in ("llama", "qwen3_moe"):
        raise ConfigError(
            f"MODEL={folder!r}: config.json model_type={model_type!r} is not one xorl trains; "
            "xorl models are 'llama' (dense) and 'qwen3_moe'"
        )
    if hf.get("rope_theta") is None and isinstance(hf.get("rope_parameters"), dict):
        hf["rope_theta"] = hf["rope_parameters"].get("rope_theta")  # transformers v5 keeps it there
    for old_name, name in _HF_ALIASES.items():  # names transformers has used for the same field
        if hf.get(name) is None and hf.get(old_name) is not None:
            hf[name] = hf[old_name]
    config = Config()
    source = f"{path}"
    for f in fields(ModelConfig):
        if f.name in hf and hf[f.name] is not None and f.name not in ("model_path", "attn_implementation"):
            set_field(config, "model", f.name, hf[f.name], source)
    weights = any(name.endswith(".safetensors") for name in os.listdir(folder))
    if weights:
        config.model.model_path = folder
    tokenizer = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tokenizer):
        config.data.tokenizer = tokenizer
    config.data.seq_len = min(8192, config.model.max_position_embeddings)
    config.data.micro_batch_size = 1
    config.train.dtype = "bfloat16"
    notes = tuple(
        f"config.json {name}={hf[name]!r} is not an xorl model field: ignored (xorl models use plain RoPE)"
        for name in _IGNORED_HF_FIELDS if hf.get(name)
    )
    if not weights:  # a config-only folder: a written config must still run
        notes += (f"no weights (*.safetensors) found in {folder}: model.model_path is left unset, so a written "
                  f"config trains from seeded initialisation; set model.model_path: {folder} once they are there",)
    return ModelSource(label=folder, config=config, notes=notes)
