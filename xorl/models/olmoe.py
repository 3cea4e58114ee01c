"""OLMoE (transformers' OlmoeForCausalLM): q/k RMSNorm over the whole projection width (all heads
at once, before the split into heads), a softmax top-k MoE whose experts are intermediate_size wide."""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family


def _read_hf(raw: dict, values: dict) -> list[str]:
    values["moe_intermediate_size"] = raw.get("intermediate_size", values.get("intermediate_size"))
    if raw.get("clip_qkv") is not None:
        return [f"clip_qkv={raw['clip_qkv']}: xorl does not clamp q/k/v; set clip_qkv to null"]
    return []


def _write_hf(spec, out: dict) -> None:
    if spec.moe_intermediate_size != spec.intermediate_size:
        raise ValueError(f"moe_intermediate_size={spec.moe_intermediate_size}: OlmoeForCausalLM's experts are "
                         f"intermediate_size={spec.intermediate_size} wide")
    out["clip_qkv"] = None


FAMILY = Family("olmoe", "OlmoeForCausalLM", moe=True, qk_norm="width", derived=("moe_intermediate_size",),
                read_hf=_read_hf, write_hf=_write_hf)
MODEL = DecoderForCausalLM
