"""Mistral (transformers' MistralForCausalLM): Llama's block without biases; ``sliding_window``
must be null (a set window is refused by schema.hf_to_fields until sliding windows land)."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

FAMILY = Family("mistral", "MistralForCausalLM", hf_extra={"sliding_window": None})
MODEL = DecoderForCausalLM
