"""gpt-oss (transformers' GptOssForCausalLM): attention with learned sinks (``self_attn.sinks``, one
logit per query head joining every softmax row) and q/k/v/o biases, layers alternating a sliding
window (``sliding_window``, 128; ``layer_types``) and full causal attention, YaRN RoPE, and on every
layer an MoE block: a router with a bias, top-k then softmax over the chosen logits (softmax scoring
with renormalised top-k: the same numbers), experts with per-expert biases and the clamped SwiGLU
``(up.clamp(-l, l) + 1) * g * sigmoid(alpha * g)``, ``g = gate.clamp(max=l)`` (swiglu_alpha 1.702,
swiglu_limit 7.0), each ``intermediate_size`` wide.

HF files name the router ``mlp.router`` and hold the experts stacked [E, in, out] with gate and up
columns interleaved (``gate_up_proj[..., ::2]`` gate, ``[..., 1::2]`` up), in bf16 or, as released,
MXFP4 (``*_blocks`` / ``*_scales``): xorl/models/mxfp4.py reads either into xorl's layout (gate
units, then up) box by box, and export writes the dense interleaved layout.
"""

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.schema import Family


def _read_hf(raw: dict, values: dict) -> list[str]:
    problems = []
    values["moe_intermediate_size"] = raw.get("intermediate_size", values.get("intermediate_size"))
    values.setdefault("attention_bias", True)  # GptOssConfig's default
    if raw.get("layer_types") is None:
        n = int(raw.get("num_hidden_layers") or values.get("num_hidden_layers") or 0)
        values["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    quant = raw.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        problems.append(f"quantization_config quant_method={quant.get('quant_method')!r}: xorl reads gpt-oss "
                        "weights in bf16 / fp32 or MXFP4 (dequantised on load) only")
    return problems


def _write_hf(spec, out: dict) -> None:
    if not out.get("layer_types"):  # spell out transformers' default, which xorl used
        out["layer_types"] = ["sliding_attention" if spec.attention_window(i) else "full_attention"
                              for i in range(spec.num_hidden_layers)]


FAMILY = Family(
    "gpt_oss", "GptOssForCausalLM", moe=True,
    hf_names={"num_experts": "num_local_experts"}, fixed={"norm_topk_prob": True},
    derived=("moe_intermediate_size",), same_as={"moe_intermediate_size": "intermediate_size"},
    read_hf=_read_hf, write_hf=_write_hf, weight_names=(("mlp.gate.", "mlp.router."),),
    attention_sinks=True, router_bias=True, expert_biases=True, clamped_swiglu=True, experts_interleaved=True,
    hf_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "num_experts_per_tok": 4,
                 "sliding_window": 128, "rope_theta": 150000.0},
)
MODEL = DecoderForCausalLM
