"""Qwen3-MoE-style decoder: per-head q_norm/k_norm in attention and a top-k MoE MLP.

Which layers are sparse follows transformers' Qwen3MoeDecoderLayer: layer i uses the MoE block
unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0; the others use a dense
SwiGLU MLP of intermediate_size.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from xorl.models.decoder import DecoderForCausalLM, hf_decoder_config
from xorl.models.layers import SwiGLUMLP
from xorl.models.spec import ModelSpec
from xorl.nn.moe import MoE


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def build_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        if not spec.is_moe_layer(layer_idx):
            return SwiGLUMLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias,
                             merge_gate_up=spec.merge_gate_up, fp8=spec.fp8)
        return MoE(
            spec.hidden_size,
            spec.num_experts,
            spec.num_experts_per_tok,
            spec.moe_intermediate_size,
            norm_topk_prob=spec.norm_topk_prob,
            scoring=spec.router_scoring,
            expert_bias=spec.router_expert_bias,
            bias_update_rate=spec.router_bias_update_rate,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            aux_loss_coef=spec.router_aux_loss_coef,
            z_loss_coef=spec.router_z_loss_coef,
            fp8=spec.fp8,
        )


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The fields of a transformers Qwen3MoeConfig for this spec."""
    if spec.router_scoring != "softmax":
        raise ValueError(
            f"router_scoring={spec.router_scoring!r} has no transformers Qwen3MoeForCausalLM equivalent "
            "(it routes with softmax); use router_scoring='softmax' to export"
        )
    if spec.shared_expert_intermediate_size:
        raise ValueError(
            f"shared_expert_intermediate_size={spec.shared_expert_intermediate_size}: transformers' "
            "Qwen3MoeForCausalLM has no shared expert, so this model cannot be exported as one"
        )
    return {
        **hf_decoder_config(spec, "Qwen3MoeForCausalLM", "qwen3_moe"),
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "decoder_sparse_step": spec.decoder_sparse_step,
        "mlp_only_layers": list(spec.mlp_only_layers),
    }
