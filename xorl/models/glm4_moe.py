"""GLM-4.5 / 4.6 (transformers' Glm4MoeForCausalLM): partial rotary (partial_rotary_factor), biases
on q/k/v (not o), the first ``first_k_dense_replace`` layers dense, then a sigmoid router with
``e_score_correction_bias`` (selection only), group-limited routing (n_group / topk_group),
renormalised top-k weights times ``routed_scaling_factor``, and an ungated shared expert of
n_shared_experts x moe_intermediate_size. The multi-token-prediction layer that HF files hold after
the last layer (num_nextn_predict_layers) is not trained; loading skips it, as transformers does."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family


def _read_hf(raw: dict, values: dict) -> list[str]:
    problems = []
    values.setdefault("partial_rotary_factor", 0.5)  # Glm4MoeConfig's default
    values["shared_expert_intermediate_size"] = int(raw.get("n_shared_experts") or 0) * int(
        raw.get("moe_intermediate_size") or 0)
    if raw.get("use_qk_norm"):
        problems.append("use_qk_norm=true is not supported for glm4_moe yet; GLM-4.5 / 4.6 ship false")
    return problems


def _write_hf(spec, out: dict) -> None:
    shared, width = spec.shared_expert_intermediate_size, spec.moe_intermediate_size
    if shared % width:
        raise ValueError(f"shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size="
                         f"{width}: Glm4MoeForCausalLM's shared expert is n_shared_experts x that wide")
    out.update(n_shared_experts=shared // width, use_qk_norm=False, num_nextn_predict_layers=0)


FAMILY = Family(
    "glm4_moe", "Glm4MoeForCausalLM", moe=True, o_proj_bias=False, shared_expert_gate=False,
    hf_names={"num_experts": "n_routed_experts", "router_n_group": "n_group", "router_topk_group": "topk_group"},
    fixed={"router_scoring": "sigmoid", "router_expert_bias": True},
    derived=("shared_expert_intermediate_size",), read_hf=_read_hf, write_hf=_write_hf,
    weight_names=(("mlp.shared_expert.", "mlp.shared_experts."),), ignore_extra_layers=True,
    hf_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "first_k_dense_replace": 1},
)
MODEL = DecoderForCausalLM
