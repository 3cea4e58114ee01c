"""What xorl-plan plans for: an xorl YAML, a local Hugging Face folder, or a bare parameter count.

- ``run.yaml``: the config as ``xorl-train`` would load it (its layout is the one ``--layout`` with
  no value evaluates).
- ``/models/Llama-3-70B/``: its ``config.json``, read as xorl-train reads it (any family,
  xorl/config/model_path.py); ``model_path`` points at the folder when it holds weights (*.safetensors;
  else it stays unset: seeded initialisation, and a note says so) and its tokenizer becomes
  ``data.tokenizer``, so ``--write-config`` starts from those weights. Only config.json (and the
  tokenizer) is read: no weights, no network.
- ``70B`` / ``7.5e9``: a parameter count, for the back-of-envelope state arithmetic of published
  tables (parameters split evenly over TP x PP [x the FSDP shards]); no shapes, so no activations,
  step time or ranking.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from xorl.config import Config, load_config
from xorl.config.errors import ConfigError

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
    # The folder read exactly as xorl-train reads it (xorl/config/model_path.py: every family, its own key
    # names, refusals naming the field; the folder's tokenizer becomes data.tokenizer).
    config = load_config(None, [f"--model.model_path={folder}"])
    config.data.seq_len = min(8192, config.model.max_position_embeddings)
    config.data.micro_batch_size = 1
    config.train.dtype = "bfloat16"
    notes: tuple[str, ...] = ()
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        # A config-only folder: a written config must still run, so it trains from seeded
        # initialisation (the architecture fields stay, read from config.json above).
        config.model.model_path = None
        notes += (f"no weights (*.safetensors) found in {folder}: model.model_path is left unset, so a written "
                  f"config trains from seeded initialisation; set model.model_path: {folder} once they are there",)
    return ModelSource(label=folder, config=config, notes=notes)
