"""OLMoE (transformers' OlmoeForCausalLM): q/k RMSNorm over the whole projection width (all heads
at once, before the split into heads; so no tensor parallelism: config_rules refuses it), a softmax
top-k MoE whose experts are intermediate_size wide."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family


def _read_hf(raw: dict, values: dict) -> list[str]:
    values["moe_intermediate_size"] = raw.get("intermediate_size", values.get("intermediate_size"))
    if raw.get("clip_qkv") is not None:
        return [f"clip_qkv={raw['clip_qkv']}: xorl does not clamp q/k/v; set clip_qkv to null"]
    return []


FAMILY = Family("olmoe", "OlmoeForCausalLM", moe=True, qk_norm="width", derived=("moe_intermediate_size",),
                same_as={"moe_intermediate_size": "intermediate_size"}, read_hf=_read_hf,
                hf_extra={"clip_qkv": None}, hf_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                                                          "num_experts_per_tok": 8, "router_aux_loss_coef": 0.01})
MODEL = DecoderForCausalLM
