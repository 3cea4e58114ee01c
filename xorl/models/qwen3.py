"""Qwen3 dense (transformers' Qwen3ForCausalLM): per-head q/k RMSNorm before RoPE."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

FAMILY = Family("qwen3", "Qwen3ForCausalLM", qk_norm="head",
                hf_extra={"use_sliding_window": False, "sliding_window": None})
MODEL = DecoderForCausalLM
