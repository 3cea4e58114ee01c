"""The model's shape rules: what makes a set of field values (xorl/models/schema.py) unbuildable.

One place: config/validate.py reports them before launch (xorl/config/rules/model.py), ModelSpec
raises them (xorl/models/spec.py), and a model folder's config.json is read through them
(xorl/models/hf_config.py). Each problem names the field (``model.`` prefixed) and what to do. No
torch import here, as in the schema.
"""

from __future__ import annotations

from typing import Any

from xorl.models.schema import FIELD, MLA, Family, plain_value


def shape_problems(m: dict[str, Any], family: Family) -> list[str]:
    """What makes field values ``m`` unbuildable, each naming the field (``model.`` prefixed)."""
    problems = [f"model.{n}={m[n]} must be >= 1" for n in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "decoder_sparse_step", "router_n_group",
        "router_topk_group") if m[n] < 1]
    problems += [f"model.{n}={m[n]} must be >= 0" for n in (
        "num_experts", "shared_expert_intermediate_size", "first_k_dense_replace") if m[n] < 0]
    if m["head_dim"] is not None and m["head_dim"] < 1:
        problems.append(f"model.head_dim={m['head_dim']} must be >= 1, or null for hidden_size // num_attention_heads")
    if problems:
        return problems
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    if heads % kv:
        problems.append(f"model.num_attention_heads={heads} must be a multiple of "
                        f"num_key_value_heads={kv} (grouped-query attention)")
    if m["model_type"] in MLA:
        problems += mla_problems(m)  # head_dim and the rotary dims are MLA's own
    else:
        problems += _head_problems(m)
    for name in ("sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit"):
        if not family.carries(name) and plain_value(m[name]) != plain_value(FIELD[name].default):
            readers = " or ".join(FIELD[name].families)
            problems.append(f"model.{name}={m[name]!r}: only model_type {readers} reads it; remove it")
    if m["sliding_window"] is not None and m["sliding_window"] < 1:
        problems.append(f"model.sliding_window={m['sliding_window']} must be >= 1 (or null)")
    kinds = ("sliding_attention", "full_attention")
    if m["layer_types"] and (len(m["layer_types"]) != m["num_hidden_layers"]
                             or any(t not in kinds for t in m["layer_types"])):
        problems.append(f"model.layer_types must list one of {kinds} for each of the num_hidden_layers="
                        f"{m['num_hidden_layers']} layers, got {list(m['layer_types'])}")
    elif "sliding_attention" in m["layer_types"] and m["sliding_window"] is None:
        problems.append("model.layer_types has sliding_attention layers but model.sliding_window is null; set it")
    if not family.moe and m["num_experts"] > 0:
        problems.append(f"model.num_experts={m['num_experts']} but model_type={m['model_type']!r} is dense; set "
                        "num_experts: 0, or a mixture-of-experts model_type (qwen3_moe, mixtral, ...)")
    if family.moe:
        e = m["num_experts"]
        if e == 0:
            problems.append(f"model.model_type={m['model_type']!r} needs num_experts >= 1 (or use a dense model_type)")
        elif not 1 <= m["num_experts_per_tok"] <= e:
            problems.append(f"model.num_experts_per_tok={m['num_experts_per_tok']} (top-k) must be between 1 and "
                            f"num_experts={e}")
        if m["moe_intermediate_size"] < 1:
            problems.append(f"model.moe_intermediate_size={m['moe_intermediate_size']} must be >= 1")
        bad = [i for i in m["mlp_only_layers"] if not 0 <= i < m["num_hidden_layers"]]
        if bad:
            problems.append(f"model.mlp_only_layers has {bad}, outside the layer indices "
                            f"0..{m['num_hidden_layers'] - 1}")
        groups, topk_group = m["router_n_group"], m["router_topk_group"]
        if e and groups > 1 and (e % groups or topk_group > groups
                                 or m["num_experts_per_tok"] > topk_group * (e // groups)):
            problems.append(f"model.router_n_group={groups}, router_topk_group={topk_group}: num_experts={e} must "
                            "split into router_n_group equal groups, router_topk_group <= router_n_group, and the "
                            "chosen groups must hold num_experts_per_tok experts")
    return problems + rope_problems(m["rope_scaling"])


def _head_problems(m: dict[str, Any]) -> list[str]:
    """head_dim and partial rotary of plain (grouped-query) attention."""
    problems, heads, head_dim = [], m["num_attention_heads"], m["head_dim"]
    if any(m[n] != FIELD[n].default for n in _MLA_FIELDS):
        problems.append(f"model.{', '.join(n for n in _MLA_FIELDS if m[n] != FIELD[n].default)}: latent attention "
                        f"fields, but model_type={m['model_type']!r} has plain attention; use one of {MLA} or "
                        "remove them")
    if head_dim is None:
        if m["hidden_size"] % heads:
            problems.append(f"model.hidden_size={m['hidden_size']} is not divisible by num_attention_heads={heads}; "
                            "set model.head_dim explicitly or change the sizes")
        head_dim = m["hidden_size"] // heads
    rotary = int(head_dim * m["partial_rotary_factor"])
    if m["partial_rotary_factor"] == 1.0 and head_dim % 2:
        problems.append(f"model: head_dim={head_dim} must be even for RoPE (model.head_dim, or hidden_size / "
                        "num_attention_heads)")
    elif not 0 < m["partial_rotary_factor"] <= 1 or rotary % 2:
        problems.append(f"model.partial_rotary_factor={m['partial_rotary_factor']} must be in (0, 1] and rotate an "
                        f"even number of dims of head_dim={head_dim} (rotates {rotary})")
    return problems


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_head_dim(m: dict[str, Any]) -> int:
    """MLA's q.k head dim: the no-RoPE and the RoPE part of each head."""
    return m["qk_nope_head_dim"] + m["qk_rope_head_dim"]


# Fields whose null means "derive me from the others" (not "off"): an explicit null sets nothing, so
# with model.model_path the folder's value stands (xorl/config/model_path.py).
DERIVED_WHEN_NULL = frozenset({"head_dim"})


def resolved_head_dim(m: dict[str, Any]) -> int | None:
    """The q.k head dim the model is built with: head_dim when set (under latent attention it must be
    qk_nope + qk_rope: mla_problems); when null, latent attention's qk_nope + qk_rope, else
    hidden_size // num_attention_heads (None while the heads are not set)."""
    if m["head_dim"] is not None:
        return m["head_dim"]
    if m["model_type"] in MLA:
        return mla_head_dim(m)
    return m["hidden_size"] // m["num_attention_heads"] if m["num_attention_heads"] else None


def mla_problems(m: dict[str, Any]) -> list[str]:
    """The latent-attention shape rules (DeepSeek-V2 / V3: xorl/models/mla.py)."""
    problems = [f"model.{n}={m[n]} must be >= 1 for model_type={m['model_type']!r}"
                for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if m[n] < 1]
    if m["q_lora_rank"] is not None and m["q_lora_rank"] < 1:
        problems.append(f"model.q_lora_rank={m['q_lora_rank']} must be >= 1, or null for one q_proj")
    if m["qk_rope_head_dim"] % 2:
        problems.append(f"model.qk_rope_head_dim={m['qk_rope_head_dim']} must be even for RoPE")
    if m["head_dim"] is not None and m["head_dim"] != mla_head_dim(m):
        problems.append(f"model.head_dim={m['head_dim']}: {m['model_type']}'s q.k head dim is qk_nope_head_dim + "
                        f"qk_rope_head_dim = {mla_head_dim(m)}; set head_dim to that or null")
    if m["num_key_value_heads"] != m["num_attention_heads"]:
        problems.append(f"model.num_key_value_heads={m['num_key_value_heads']} must equal num_attention_heads="
                        f"{m['num_attention_heads']}: latent attention gives every head its own key and value")
    if m["partial_rotary_factor"] != 1.0:
        problems.append(f"model.partial_rotary_factor={m['partial_rotary_factor']}: latent attention rotates "
                        "qk_rope_head_dim dims of each head; set it to 1.0")
    if m["merge_qkv"]:
        problems.append(f"model.merge_qkv=true: {m['model_type']}'s latent attention has no q/k/v projections to "
                        "merge (its keys and values come from one latent already); set merge_qkv: false")
    return problems


ROPE_TYPES = ("llama3", "linear", "yarn")


def rope_problems(scaling: dict | None) -> list[str]:
    """What makes a RoPE scaling unbuildable (or untrainable), naming model.rope_scaling."""
    if not scaling:
        return []
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "dynamic":
        return ["model.rope_scaling rope_type 'dynamic' is refused: dynamic NTK rescales the frequencies with the "
                "length of the sequence being generated, an inference-time scheme with no fixed positions to train "
                "on; train with plain RoPE, or 'linear' / 'yarn' with a fixed factor"]
    if kind not in ROPE_TYPES:
        return [f"model.rope_scaling rope_type={kind!r} is not supported; use one of {ROPE_TYPES} (or null)"]
    if "factor" not in scaling:
        return [f"model.rope_scaling ({kind}) needs 'factor'"]
    if kind == "llama3" and not {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} <= set(
            scaling):
        return ["model.rope_scaling (llama3) needs low_freq_factor, high_freq_factor and "
                "original_max_position_embeddings"]
    return []
