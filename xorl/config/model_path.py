"""``model.model_path``: the Hugging Face folder's config.json defines the model.

Hugging Face users expect the folder to define the architecture, so every model field that its
config.json holds is taken from it. The YAML or CLI may repeat a field with the same value; another
value is an error that names both. Fields config.json does not hold (xorl's own ``merge_qkv``,
``attn_implementation``, ``router_scoring``, ... and anything the file leaves out) keep the
config's value. Two kinds of entries are not architecture and stay the user's to set:
``TRAINING_KNOBS`` (loss coefficients and the init scale, which a loaded model never uses) take the
file's value unless the YAML or CLI sets them, which then wins.

The file is read through its family's declaration (xorl/models/hf_config.py ``hf_to_fields``: the
family's own key names, the values its transformers class hard-codes); features xorl.models cannot
build exactly (another activation, dynamic RoPE, MLP biases, sliding windows, dropout, ...) are
refused here, before anything is built, naming the file and the field.

    problems = apply_model_path(config)          # load_config: fill the fields, list conflicts
    problems = model_path_conflicts(config.model)  # validate_config: any field that disagrees
    problems = model_path_weight_problems(config)  # prepare_run: do the weights fit the model?

No torch import at module level: this runs before any process group exists (the weights check
builds the model on the meta device, so it imports torch when it runs).
"""

from __future__ import annotations

import json
import os
from typing import Any

from xorl.config.errors import ConfigError
from xorl.models.hf_config import hf_to_fields
from xorl.models.schema import FIELD, LOCAL_FIELDS, TRAINING_KNOBS
from xorl.models.shape_rules import DERIVED_WHEN_NULL, resolved_head_dim

HF_CONFIG_NAME = "config.json"
__all__ = ["LOCAL_FIELDS", "TRAINING_KNOBS", "apply_model_path", "hf_model_fields", "model_path_conflicts"]


def read_hf_config(folder: str) -> dict[str, Any]:
    """The folder's config.json as a dict; a ConfigError naming the file when it cannot be read."""
    path = os.path.join(folder, HF_CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"model.model_path={folder!r}: cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.model_path={folder!r}: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.model_path={folder!r}: {path} must hold a JSON object")
    return data


def hf_model_fields(folder: str) -> tuple[dict[str, Any], list[str]]:
    """(ModelConfig field -> value that ``folder``'s config.json defines, problems found in it)."""
    from xorl.config.field_types import coerce
    from xorl.models.families import MODEL_TYPES, family

    raw = read_hf_config(folder)
    path = os.path.join(folder, HF_CONFIG_NAME)
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        return {}, [f"{path}: model_type={model_type!r} is not one of {list(MODEL_TYPES)}"]
    found, problems = hf_to_fields(raw, family(model_type), path)
    values: dict[str, Any] = {}
    for name, value in found.items():
        if name in LOCAL_FIELDS:
            continue
        try:
            values[name] = value if value is None else coerce(value, FIELD[name].type, f"{path}: {name}")
        except ConfigError as e:
            problems += e.problems
    return values, problems


def apply_model_path(config: Any) -> list[str]:
    """Fill ``config.model`` from its model_path's config.json; return the problems.

    A field set explicitly (``config.origins``) to another value than the file's is a conflict,
    except the TRAINING_KNOBS, where the explicit value wins. A missing config.json is left to
    validate_config, which names it.
    """
    model = config.model
    if not os.path.isfile(os.path.join(model.model_path, HF_CONFIG_NAME)):
        return []
    try:
        values, problems = hf_model_fields(model.model_path)
    except ConfigError as e:
        return e.problems
    for name, value in values.items():
        origin = config.origins.get(f"model.{name}")
        # An explicit null of a derived field (head_dim: null) sets nothing: the folder's value stands.
        if origin is None or (name in DERIVED_WHEN_NULL and getattr(model, name) is None):
            setattr(model, name, value)
        elif name not in TRAINING_KNOBS and not _same(model, name, value):
            problems.append(_conflict(model, name, value, origin))
    from xorl.data.tokenizer import has_tokenizer

    # The tokenizer comes with the model: the folder's, unless data.tokenizer is set explicitly.
    if config.origins.get("data.tokenizer") is None and has_tokenizer(model.model_path):
        config.data.tokenizer = model.model_path
    return problems


def model_path_conflicts(model: Any) -> list[str]:
    """Every field the folder's config.json defines must equal ``model``'s (a config built in code)."""
    if model.model_path is None or not os.path.isfile(os.path.join(model.model_path, HF_CONFIG_NAME)):
        return []
    try:
        values, problems = hf_model_fields(model.model_path)
    except ConfigError as e:
        return e.problems
    for name, value in values.items():
        if name not in TRAINING_KNOBS and not _same(model, name, value):
            problems.append(_conflict(model, name, value, None))
    return problems


def _same(model: Any, name: str, value: Any) -> bool:
    current = getattr(model, name)
    if name == "head_dim":  # null: the family's derived head dim (resolved_head_dim)
        fields = {n: getattr(model, n) for n in ("model_type", "hidden_size", "num_attention_heads",
                                                 "qk_nope_head_dim", "qk_rope_head_dim")}
        return resolved_head_dim({**fields, "head_dim": current}) == resolved_head_dim({**fields, "head_dim": value})
    return current == value


def _conflict(model: Any, name: str, value: Any, origin: str | None) -> str:
    path = os.path.join(model.model_path, HF_CONFIG_NAME)
    where = f" (set by {origin})" if origin else ""
    return (
        f"model.{name}={getattr(model, name)!r}{where} conflicts with {name}={value!r} in {path}: the model "
        f"folder defines the architecture; remove model.{name} from the config or set it to {value!r}"
    )


def model_path_weight_problems(config: Any) -> list[str]:
    """What stops ``model.model_path``'s weights loading into the configured model: missing or
    unexpected tensors, shape mismatches, unreadable files ([] when they fit, or no model_path).
    Reads the safetensors headers only, so a 70B folder is checked in a second."""
    folder = config.model.model_path
    if not folder:
        return []
    damaged = weight_file_problems(folder)
    if damaged:
        return damaged
    import torch

    from xorl.models.hf_reader import hf_folder_problems
    from xorl.models.registry import build_model

    with torch.device("meta"):
        model = build_model(config.model)
    return [f"model.model_path={folder!r} does not match the model section: {p}"
            for p in hf_folder_problems(model, folder)]


SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_file_problems(folder: str) -> list[str]:
    """Every weight file of ``folder`` that cannot be read, named: one the index lists but the folder
    lacks ("missing"), a header cut short or not JSON, a file shorter or longer than its header says
    (a copy cut short), a tensor the index places in a file whose header lacks it. Reads the headers
    only (8 bytes of length, then JSON), so a 70B folder is checked in a second before any process
    group starts, and each problem names its file instead of safetensors' bare "incomplete metadata"."""
    where = f"model.model_path={folder!r}"
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    weight_map: dict[str, str] = {}
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [f"{where}: {index_path} is unreadable or has no weight_map ({e}); repair or re-download it"]
        files = sorted(set(weight_map.values()))
    elif os.path.isdir(folder):
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        if not files:
            return [f"{where}: no *.safetensors files (nor {SAFETENSORS_INDEX}) in {folder}"]
    else:
        return []  # validate_config names a missing folder
    problems = []
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{where}: {path} is missing ({SAFETENSORS_INDEX} lists it); copy or download it again")
            continue
        header, problem = _read_safetensors_header(path)
        if problem:
            problems.append(f"{where}: {path} {problem}; the file is damaged or cut short: copy or download it again")
            continue
        in_file = set(header) - {"__metadata__"}
        absent = sorted(k for k, v in weight_map.items() if v == name and k not in in_file)
        if absent:
            problems.append(f"{where}: {index_path} places {len(absent)} tensors in {name} that it does not hold "
                            f"({', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''})")
    return problems


def _read_safetensors_header(path: str) -> tuple[dict[str, Any], str | None]:
    """(the header of a .safetensors file, or what is wrong with the file against it)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return {}, f"has {size} bytes, too few for a safetensors header"
            length = int.from_bytes(prefix, "little")
            if length > size - 8:
                return {}, f"has {size} bytes but its header alone needs {8 + length}"
            header = json.loads(f.read(length))
    except OSError as e:
        return {}, f"cannot be read ({e.strerror})"
    except (ValueError, UnicodeDecodeError):
        return {}, "has a header that is not valid JSON"
    if not isinstance(header, dict):
        return {}, "has a header that is not a JSON object"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return {}, "has a header without valid data_offsets"
    if size != 8 + length + end:
        return {}, f"has {size} bytes, its header describes {8 + length + end}"
    return header, None
