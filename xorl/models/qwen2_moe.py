"""Qwen2-MoE (transformers' Qwen2MoeForCausalLM): q/k/v biases (``qkv_bias``), a softmax top-k
MoE and a shared expert gated by sigmoid(shared_expert_gate(x))."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", moe=True, o_proj_bias=False,
                hf_names={"attention_bias": "qkv_bias"},
                hf_extra={"use_sliding_window": False, "sliding_window": None},
                hf_defaults={"num_experts_per_tok": 4, "max_position_embeddings": 32768})
MODEL = DecoderForCausalLM
