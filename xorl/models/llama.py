"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 (transformers' LlamaForCausalLM): RoPE scaling llama3 / linear /
yarn, tied embeddings (3.2 1B / 3B), attention_bias on q/k/v/o."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

FAMILY = Family("llama", "LlamaForCausalLM")


class LlamaForCausalLM(DecoderForCausalLM):
    """Embeddings, N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP), final norm, lm_head."""


MODEL = LlamaForCausalLM
