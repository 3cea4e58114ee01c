"""Llama-style dense decoder (transformers' LlamaForCausalLM names and arithmetic)."""

from __future__ import annotations

from typing import Any

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.spec import ModelSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """Embeddings, N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP), final norm, lm_head."""


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The fields of a transformers LlamaConfig for this spec."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": spec.mlp_bias,
    }
