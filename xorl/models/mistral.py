"""Mistral (transformers' MistralForCausalLM): Llama's block without biases, and on every layer the
same causal ``sliding_window`` when it is set (Mistral 7B v0.1: 4096; v0.2 / v0.3: null, full
attention). A config.json without the key gets MistralConfig's default, 4096, as transformers does."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family

HF_DEFAULT_SLIDING_WINDOW = 4096  # MistralConfig's, for a file that leaves the key out


def _read_hf(raw: dict, values: dict) -> list[str]:
    if "sliding_window" not in raw:
        values["sliding_window"] = HF_DEFAULT_SLIDING_WINDOW
    return []


FAMILY = Family("mistral", "MistralForCausalLM", read_hf=_read_hf, every_layer_slides=True)
MODEL = DecoderForCausalLM
