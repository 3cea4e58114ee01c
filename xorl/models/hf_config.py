"""config.json <-> the schema's field values (xorl/models/schema.py), through each family's declaration.

``hf_to_fields`` reads a transformers config.json (v4 or v5 RoPE keys), refusing what xorl cannot
build exactly; ``fields_to_hf`` writes one that the family's transformers class loads, refusing a value
it cannot hold. No torch import here, as in the schema.
"""

from __future__ import annotations

from typing import Any

from xorl.models.schema import FIELDS, MOE, Family, plain_value
from xorl.models.shape_rules import rope_problems


def _rope_from_hf(raw: dict) -> tuple[float | None, dict | None, float | None]:
    """(rope_theta, scaling without theta or None, partial_rotary_factor) from a transformers v4 or
    v5 config.json (v5 keeps all of it in ``rope_parameters``, v4 in rope_theta / rope_scaling)."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta", params.get("rope_theta", legacy.get("rope_theta")))
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    scaling = {**params, **legacy}  # a v4 rope_scaling next to v5's rope_parameters is the one meant
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return theta, scaling, partial


def hf_to_fields(raw: dict, family: Family, where: str) -> tuple[dict[str, Any], list[str]]:
    """(field -> value that config.json ``raw`` defines, problems naming ``where``). Values are not
    coerced to the field types here (xorl/config/model_path.py does that, naming the file)."""
    problems = []
    values: dict[str, Any] = {}
    for f in FIELDS:
        if f.kind == "local" or not family.carries(f.name):
            continue
        for key in family.hf_keys(f.name):
            if raw.get(key) is not None:
                values[f.name] = raw[key]
                break
        else:
            if f.name in family.hf_defaults and not any(key in raw for key in family.hf_keys(f.name)):
                values[f.name] = family.hf_defaults[f.name]
    theta, scaling, partial = _rope_from_hf(raw)
    if theta is None and "rope_theta" in family.hf_defaults:
        theta = family.hf_defaults["rope_theta"]
    if theta is not None:
        values["rope_theta"] = theta
    values["rope_scaling"] = scaling
    problems += [p.replace("model.rope_scaling", "rope_scaling") for p in rope_problems(scaling)]
    if partial is not None and partial != 1.0:
        if not family.carries("partial_rotary_factor"):
            problems.append(f"{where}: partial_rotary_factor={partial}: {family.architecture} rotates whole heads")
        values["partial_rotary_factor"] = partial
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"{where}: hidden_act={raw['hidden_act']!r}; xorl.models use SwiGLU (silu) only")
    if raw.get("mlp_bias"):
        problems.append(f"{where}: mlp_bias=true is not supported by xorl.models")
    if raw.get("attention_dropout"):
        problems.append(f"{where}: attention_dropout={raw['attention_dropout']}; xorl.models have no dropout")
    if raw.get("use_sliding_window"):
        problems.append(f"{where}: use_sliding_window=true: sliding-window attention is not supported yet; "
                        "set it to false")
    elif ("use_sliding_window" not in raw and raw.get("sliding_window") is not None
          and not family.carries("sliding_window")):
        problems.append(f"{where}: sliding_window={raw['sliding_window']}: sliding-window attention is not "
                        "supported yet (it lands with the sliding-window issue); set sliding_window to null")
    for name, value in family.fixed.items():
        key = family.hf_key(name)
        if key in raw and raw[key] != value and raw[key] is not None:
            problems.append(f"{where}: {key}={raw[key]!r}; {family.architecture} always has {value!r}")
        values[name] = value
    if family.read_hf is not None:
        problems += family.read_hf(raw, values)
    return values, [p if p.startswith(where) else f"{where}: {p}" for p in problems]


_MOE_ONLY = {f.name for f in FIELDS if f.families and set(f.families) <= set(MOE)} | {
    "router_scoring", "router_expert_bias", "router_group_score"}


def fields_to_hf(spec: Any, family: Family) -> dict[str, Any]:
    """The config.json dict of ``spec`` that transformers' ``family.architecture`` loads; ValueError
    naming the field when a value cannot be represented there."""
    out: dict[str, Any] = {"architectures": [family.architecture], "model_type": family.model_type}
    for f in FIELDS:
        value = getattr(spec, f.name)
        if f.kind == "local" or f.name in ("model_type", "rope_theta", "rope_scaling", "partial_rotary_factor"):
            continue
        if family.carries(f.name):
            out[family.hf_key(f.name)] = list(value) if isinstance(value, tuple) else value
        elif (f.kind == "arch" and plain_value(value) != plain_value(family.fixed.get(f.name, f.default))
              and f.name not in family.derived and (family.moe or f.name not in _MOE_ONLY)):
            raise ValueError(f"{f.name}={value!r} has no {family.architecture} equivalent (it always has "
                             f"{family.fixed.get(f.name, f.default)!r}), so this model cannot be exported as one")
    rope = {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta}
    if spec.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = spec.partial_rotary_factor
    out.update(hidden_act="silu", attention_dropout=0.0, rope_theta=spec.rope_theta, rope_parameters=rope,
               **family.hf_extra)
    if spec.rope_scaling:
        out["rope_scaling"] = {**spec.rope_scaling}  # what transformers v4 reads
    if family.write_hf is not None:
        family.write_hf(spec, out)
    return out
