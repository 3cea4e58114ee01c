"""Mixtral (transformers' MixtralForCausalLM): every layer a softmax router over all experts,
top-k (2), renormalised; each expert is intermediate_size wide. HF files name the block
``block_sparse_moe`` and the expert projections w1 (gate), w3 (up), w2 (down)."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family


def _read_hf(raw: dict, values: dict) -> list[str]:
    values["moe_intermediate_size"] = raw.get("intermediate_size", values.get("intermediate_size"))
    if raw.get("router_jitter_noise"):
        return [f"router_jitter_noise={raw['router_jitter_noise']}: xorl routes without noise; set it to 0"]
    return []


FAMILY = Family(
    "mixtral", "MixtralForCausalLM", moe=True,
    hf_names={"num_experts": "num_local_experts"}, fixed={"norm_topk_prob": True},
    derived=("moe_intermediate_size",), same_as={"moe_intermediate_size": "intermediate_size"},
    read_hf=_read_hf, hf_extra={"sliding_window": None, "router_jitter_noise": 0.0},
    hf_defaults={"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 4096 * 32},
    weight_names=(("mlp.experts.{j}.gate_proj.", "block_sparse_moe.experts.{j}.w1."),
                  ("mlp.experts.{j}.up_proj.", "block_sparse_moe.experts.{j}.w3."),
                  ("mlp.experts.{j}.down_proj.", "block_sparse_moe.experts.{j}.w2."),
                  ("mlp.gate.", "block_sparse_moe.gate.")),
)
MODEL = DecoderForCausalLM
