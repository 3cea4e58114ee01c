"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): per-head q/k RMSNorm, a softmax top-k MoE.

Which layers are sparse follows transformers' Qwen3MoeDecoderLayer: layer i uses the MoE block
unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (ModelSpec.is_moe_layer).
xorl may also train it with sigmoid scoring, a shared expert or an expert bias (router_scoring,
shared_expert_intermediate_size, router_expert_bias); such a model cannot be exported as Qwen3-MoE.
"""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", moe=True, qk_norm="head",
                # hub files say num_experts; transformers 5 writes num_local_experts
                hf_names={"num_experts": ("num_experts", "num_local_experts")},
                hf_extra={"use_sliding_window": False, "sliding_window": None},
                hf_defaults={"num_experts_per_tok": 8, "max_position_embeddings": 32768})


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    pass


MODEL = Qwen3MoeForCausalLM
