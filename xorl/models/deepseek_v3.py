"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (transformers' DeepseekV3ForCausalLM).

Attention is multi-head latent attention (xorl/models/mla.py: q with or without q_lora_rank, the
kv latent, the RoPE / no-RoPE split of each head, YaRN with its mscale on the softmax scale,
interleaved RoPE pairs by default). The first ``first_k_dense_replace`` layers have a dense SwiGLU
MLP, the rest an MoE block: a sigmoid router whose ``e_score_correction_bias`` (our aux-free
balancing bias) enters the selection only, group-limited top-k (n_group / topk_group, a group ranked
by its two best biased scores), top-k weights renormalised (norm_topk_prob) and times
``routed_scaling_factor``, plus an ungated shared expert n_shared_experts x moe_intermediate_size
wide. The multi-token-prediction layers the released files hold after the last layer
(num_nextn_predict_layers) are not trained; loading skips them, as transformers does.
"""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family
from xorl.models.shape_rules import mla_head_dim


def read_mla(raw: dict, values: dict, hf_defaults: dict) -> list[str]:
    """What DeepSeek-V2 and V3 config.json files share: the config class's defaults for the keys a
    file leaves out (``hf_defaults``: config.json key -> (field, value)), head_dim is the q.k head dim
    here (transformers writes qk_rope_head_dim there), the shared expert's width."""
    problems = []
    for key, (name, value) in hf_defaults.items():
        if key not in raw and name is not None:
            values[name] = value
    raw = {**{key: value for key, (_, value) in hf_defaults.items()}, **raw}
    if all(values.get(n) is not None for n in ("qk_nope_head_dim", "qk_rope_head_dim")):
        values["head_dim"] = mla_head_dim(values)
    values["shared_expert_intermediate_size"] = int(raw.get("n_shared_experts") or 0) * int(
        raw.get("moe_intermediate_size") or 0)
    if raw.get("num_key_value_heads") is None and raw.get("num_attention_heads") is not None:
        values["num_key_value_heads"] = raw["num_attention_heads"]  # what the HF config class fills in
    return problems


def write_mla(spec, out: dict) -> None:
    shared, width = spec.shared_expert_intermediate_size, spec.moe_intermediate_size
    if shared % width:
        raise ValueError(f"shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size="
                         f"{width}: {spec.family.architecture}'s shared expert is n_shared_experts x that wide")
    # transformers' config sets head_dim = qk_rope_head_dim (its rotary tables' width); MTP layers: none.
    out.update(n_shared_experts=shared // width, head_dim=spec.qk_rope_head_dim, num_nextn_predict_layers=0)


# DeepseekV3Config's defaults of the latent-attention and routing keys (hub files leave some out,
# e.g. rope_interleave).
HF_DEFAULTS = {
    "q_lora_rank": ("q_lora_rank", 1536), "kv_lora_rank": ("kv_lora_rank", 512),
    "qk_nope_head_dim": ("qk_nope_head_dim", 128), "qk_rope_head_dim": ("qk_rope_head_dim", 64),
    "v_head_dim": ("v_head_dim", 128), "rope_interleave": ("rope_interleave", True),
    "n_routed_experts": ("num_experts", 256), "num_experts_per_tok": ("num_experts_per_tok", 8),
    "moe_intermediate_size": ("moe_intermediate_size", 2048), "n_shared_experts": (None, 1),
    "n_group": ("router_n_group", 8), "topk_group": ("router_topk_group", 4),
    "norm_topk_prob": ("norm_topk_prob", True), "routed_scaling_factor": ("routed_scaling_factor", 2.5),
    "first_k_dense_replace": ("first_k_dense_replace", 3),
}


def _read_hf(raw: dict, values: dict) -> list[str]:
    return read_mla(raw, values, HF_DEFAULTS)


FAMILY = Family(
    "deepseek_v3", "DeepseekV3ForCausalLM", moe=True, shared_expert_gate=False,
    hf_names={"num_experts": "n_routed_experts", "router_n_group": "n_group", "router_topk_group": "topk_group"},
    fixed={"router_scoring": "sigmoid", "router_expert_bias": True},
    derived=("shared_expert_intermediate_size",), read_hf=_read_hf, write_hf=write_mla,
    weight_names=(("mlp.shared_expert.", "mlp.shared_experts."),), ignore_extra_layers=True,
    hf_defaults={"max_position_embeddings": 4096},  # the latent-attention and routing keys: HF_DEFAULTS
)
MODEL = DecoderForCausalLM
