"""The model section's own rules: the schema's shape rules, the attention backend, the router.

Models and backends are imported inside the functions: the run-folder refusal (xorl/run/preflight.py)
comes before torch is imported, and must stay fast."""

from __future__ import annotations

from typing import Any


def model_problems(m: Any) -> list[str]:
    """The schema's shape rules (xorl/models/shape_rules.py: the same ones ModelSpec raises)."""
    from xorl.models.families import family
    from xorl.models.schema import apply_family, field_values
    from xorl.models.shape_rules import shape_problems

    values = field_values(m)
    values["head_dim"], values["rope_scaling"] = m.head_dim, m.rope_scaling
    fam = family(m.model_type)
    problems = apply_family(values, fam) + shape_problems(values, fam)
    if getattr(m, "model_path", None) and problems:
        problems = [p + _as_the_folder_spells_it(p, m.model_path, fam) for p in problems]
    return problems


def _as_the_folder_spells_it(problem: str, folder: str, fam: Any) -> str:
    """Where the fields a problem names come from when the folder's config.json set them, in the
    file's own keys (Mixtral's num_experts is num_local_experts there, DeepSeek's n_routed_experts):
    the user fixes the file, not the YAML, which may not set a field the folder defines."""
    import os
    import re

    from xorl.config.model_path import HF_CONFIG_NAME, read_hf_config
    from xorl.models.schema import FIELD

    raw = read_hf_config(folder)
    found = []
    for name in dict.fromkeys(re.findall(r"\b([a-z_]+)=", problem)):
        key = next((k for k in fam.hf_keys(name) if k in raw), None) if name in FIELD else None
        if key is not None:
            found.append(f"{key}={raw[key]}")
    if not found:
        return ""
    return f" ({os.path.join(folder, HF_CONFIG_NAME)} has {', '.join(found)}: correct the folder's config.json)"


def attention_problems(m: Any, local: bool = True) -> list[str]:
    """``local``: also whether this machine has the attention package (validate_config)."""
    from xorl.nn.attention_backends import FLASH_ATTN, attention_backend, missing_package

    problems = []
    package = missing_package(m.attn_implementation) if local else None
    if package is not None:
        pip_name = package.replace("_", "-")
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} but the {pip_name} package is not installed; "
            f"use attn_implementation: xorl (our Triton kernels) or pip install {pip_name}"
        )
    # Sinks and sliding windows run on xorl's kernels and on sdpa (plain torch), not on the package.
    features = _attention_features(m)
    if features and attention_backend(m.attn_implementation).local == FLASH_ATTN:
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} with model_type={m.model_type!r}: the "
            f"flash-attn package is not wired for its {' and '.join(features)}; use attn_implementation: "
            "xorl (or sdpa)"
        )
    return problems


def _attention_features(m: Any) -> list[str]:
    """What the model's attention needs beyond plain causal softmax: sinks (a family trait), windows."""
    from xorl.models.families import MODEL_TYPES, family

    features = []
    if m.model_type in MODEL_TYPES and getattr(family(m.model_type), "attention_sinks", False):
        features.append("attention sinks")
    if getattr(m, "sliding_window", None) is not None:
        features.append("sliding windows")
    return features


def router_problems(m: Any) -> list[str]:
    problems = []
    if m.router_expert_bias and m.num_experts == 0:
        problems.append("model.router_expert_bias=true needs an MoE model (num_experts > 0); remove it")
    if not m.router_bias_update_rate > 0:
        problems.append(f"model.router_bias_update_rate={m.router_bias_update_rate} must be > 0")
    # A negative weight would reward imbalance (gradient descent then drives tokens onto fewer experts).
    problems += [f"model.{n}={getattr(m, n)} must be >= 0 (0: off)"
                 for n in ("router_aux_loss_coef", "router_z_loss_coef") if not getattr(m, n) >= 0]
    return problems
