"""DeepSeek-V2 / V2-Lite / V2.5 (transformers' DeepseekV2ForCausalLM): the same latent attention as
DeepSeek-V3 (xorl/models/mla.py; RoPE always on interleaved pairs) and the same block wiring
(first_k_dense_replace dense layers, an ungated shared expert of n_shared_experts x
moe_intermediate_size), with V2's router: softmax scores, no selection bias, top-k over all experts
(``topk_method: greedy``) or inside the topk_group best of n_group groups, a group ranked by its best
score (``group_limited_greedy``), the chosen weights times ``routed_scaling_factor`` and never
renormalised (transformers' DeepseekV2TopkRouter ignores norm_topk_prob, so a file with
norm_topk_prob=true is refused rather than trained another way)."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.deepseek_v3 import read_mla, write_mla
from xorl.models.schema import Family

TOPK_METHODS = ("greedy", "group_limited_greedy")
# DeepseekV2Config's defaults of the latent-attention and routing keys.
HF_DEFAULTS = {
    "q_lora_rank": ("q_lora_rank", 1536), "kv_lora_rank": ("kv_lora_rank", 512),
    "qk_nope_head_dim": ("qk_nope_head_dim", 128), "qk_rope_head_dim": ("qk_rope_head_dim", 64),
    "v_head_dim": ("v_head_dim", 128), "n_routed_experts": ("num_experts", 64),
    "moe_intermediate_size": ("moe_intermediate_size", 1407), "n_shared_experts": (None, 2),
    "routed_scaling_factor": ("routed_scaling_factor", 1.0), "first_k_dense_replace": ("first_k_dense_replace", 0),
}


def _read_hf(raw: dict, values: dict) -> list[str]:
    problems = read_mla(raw, values, HF_DEFAULTS)
    method = raw.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        problems.append(f"topk_method={method!r}: DeepseekV2ForCausalLM routes with one of {TOPK_METHODS}")
    elif method == "greedy":  # transformers then ignores n_group / topk_group
        values["router_n_group"] = values["router_topk_group"] = 1
    return problems


def _write_hf(spec, out: dict) -> None:
    write_mla(spec, out)
    out.pop("num_nextn_predict_layers")
    grouped = spec.router_n_group > 1
    out.update(topk_method="group_limited_greedy" if grouped else "greedy", norm_topk_prob=False,
               n_group=spec.router_n_group if grouped else None, topk_group=spec.router_topk_group if grouped else None)


FAMILY = Family(
    "deepseek_v2", "DeepseekV2ForCausalLM", moe=True, shared_expert_gate=False,
    hf_names={"num_experts": "n_routed_experts", "router_n_group": "n_group", "router_topk_group": "topk_group"},
    fixed={"router_scoring": "softmax", "router_expert_bias": False, "norm_topk_prob": False,
           "router_group_score": "max", "rope_interleave": True},
    derived=("shared_expert_intermediate_size",), read_hf=_read_hf, write_hf=_write_hf,
    weight_names=(("mlp.shared_expert.", "mlp.shared_experts."),),
)
MODEL = DecoderForCausalLM
