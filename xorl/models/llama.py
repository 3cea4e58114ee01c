"""Llama-style dense decoder (transformers' LlamaForCausalLM names and arithmetic)."""

from __future__ import annotations

from typing import Any

from xorl.models.decoder import DecoderForCausalLM, hf_decoder_config
from xorl.models.spec import ModelSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """Embeddings, N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP), final norm, lm_head."""


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The fields of a transformers LlamaConfig for this spec."""
    return {**hf_decoder_config(spec, "LlamaForCausalLM", "llama"), "mlp_bias": spec.mlp_bias}
