"""ModelSpec: one validated, fully resolved view of a model config.

Why: the models accept a ``xorl.config.ModelConfig``, any object with its attribute names, or a
``transformers`` config (read through the family's config.json names). The fields are the schema's
(xorl/models/schema.py), resolved (head_dim an int, lists as tuples) and checked by the schema's
shape rules; the family's fixed traits (q/k norm, o_proj bias, ...) are properties.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xorl.models.hf_config import hf_to_fields
from xorl.models.schema import FIELDS, MLA, Family, apply_family, field_values
from xorl.models.shape_rules import resolved_head_dim, shape_problems

# merge_qkv's layout of ``self_attn.qkv_proj`` (rows grouped by KV head: xorl/models/attention.py),
# recorded in checkpoints (trainer_state.json) so that one saved in another layout is never read as
# this one (xorl before 2026-11-24 saved [q; k; v]).
QKV_LAYOUT = "kv_groups"
# The MoE experts' layout (``experts.gate_up_proj`` [E, H, 2I] and ``down_proj``: xorl/nn/moe_experts.py),
# recorded the same way: xorl before 2026-11-24 saved separate experts.gate_proj / up_proj.
EXPERTS_LAYOUT = "gate_up"


class _SpecMethods:
    """What the modules ask of a spec beyond its fields."""

    @property
    def family(self) -> Family:
        from xorl.models.families import family

        return family(self.model_type)

    @property
    def is_moe(self) -> bool:
        return self.family.moe

    @property
    def qk_norm(self) -> str:
        """"none", "head" (RMSNorm over head_dim, Qwen3) or "width" (over the whole projection, OLMoE)."""
        return self.family.qk_norm

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias if self.family.o_proj_bias is None else self.family.o_proj_bias

    @property
    def mlp_bias(self) -> bool:
        return False

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 / V3: xorl/models/mla.py)."""
        return self.model_type in MLA

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (MLA: the qk_rope_head_dim part)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_window(self, layer_idx: int) -> int | None:
        """The sliding window W of layer ``layer_idx`` (a query at p attends keys p-W < k <= p), or None
        for full causal attention: layer_types, by default the family's (Family.default_layer_types)."""
        if self.sliding_window is None:
            return None
        types = self.layer_types or self.family.default_layer_types(self.num_hidden_layers)
        return self.sliding_window if types[layer_idx] == "sliding_attention" else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: Qwen-MoE's mlp_only_layers / decoder_sparse_step, GLM's first_k_dense_replace."""
        return (
            self.is_moe
            and self.num_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        if isinstance(config, ModelSpec):
            return config
        from xorl.models.families import MODEL_TYPES, family

        model_type = getattr(config, "model_type", None) or ""
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported; use one of {list(MODEL_TYPES)}")
        fam = family(model_type)
        if type(config).__module__.startswith("transformers."):  # a transformers config: its HF names
            values = field_values(object())
            hf_values, problems = hf_to_fields(config.to_dict(), fam, f"{type(config).__name__}")
            values.update(hf_values)
            problems += apply_family(values, fam)
            values["attn_implementation"] = getattr(config, "attn_implementation", None)
            values["model_type"] = model_type
        else:
            values = field_values(config)
            problems = apply_family(values, fam)
            values["attn_implementation"] = getattr(config, "attn_implementation", None)
        problems += shape_problems(values, fam)
        if problems:
            raise ValueError("; ".join(p.removeprefix("model.") for p in problems))
        values["head_dim"] = resolved_head_dim(values)
        values["mlp_only_layers"] = tuple(int(i) for i in values["mlp_only_layers"])
        values["layer_types"] = tuple(str(t) for t in values["layer_types"])
        values["rope_scaling"] = dict(values["rope_scaling"]) if values["rope_scaling"] else None
        return cls(**values)


ModelSpec = dataclasses.make_dataclass(
    "ModelSpec",
    [(f.name, f.type) for f in FIELDS]
    # FP8 recipe of the projections (train.fp8, a compute choice of the build, not a model field and
    # not part of the checkpoint): "none", "tensorwise", "rowwise" or "blockwise" (xorl/nn/linear.py).
    + [("fp8", str, dataclasses.field(default="none"))],
    bases=(_SpecMethods,), frozen=True, eq=True,
)
ModelSpec.__module__ = __name__
ModelSpec.__doc__ = "The resolved model config (fields: xorl/models/schema.py FIELDS)."
