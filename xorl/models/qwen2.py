"""Qwen2 / Qwen2.5 dense (transformers' Qwen2ForCausalLM): biases on q, k, v, none on o."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

FAMILY = Family("qwen2", "Qwen2ForCausalLM", o_proj_bias=False, fixed={"attention_bias": True},
                hf_extra={"use_sliding_window": False, "sliding_window": None})
MODEL = DecoderForCausalLM
