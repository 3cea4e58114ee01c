"""ModelSpec: one validated, fully resolved view of a model config.

Why: the models accept any object with the Hugging Face attribute names (a `transformers` config
or `xorl.config.ModelConfig`). The two differ in details (transformers v5 keeps rope_theta inside
``rope_parameters``; xorl-only fields such as ``merge_qkv`` are absent from HF configs), so every
``getattr`` with a default and every validity check lives here, once, and the modules read plain
fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen3_moe")
ROUTER_SCORINGS = ("softmax", "sigmoid")


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    if theta is None:
        theta = rope_parameters.get("rope_theta", 10000.0)
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters.rope_type={rope_type!r} is not supported by xorl.models (only plain RoPE); "
            "use a checkpoint without RoPE scaling or set rope_type='default'"
        )
    return float(theta)


# merge_qkv's layout of ``self_attn.qkv_proj`` (rows grouped by KV head: xorl/models/attention.py),
# recorded in checkpoints (trainer_state.json) so that one saved in another layout is never read as
# this one (xorl before 2026-11-24 saved [q; k; v]).
QKV_LAYOUT = "kv_groups"
# The MoE experts' layout (``experts.gate_up_proj`` [E, H, 2I] and ``down_proj``: xorl/nn/moe_experts.py),
# recorded the same way: xorl before 2026-11-24 saved separate experts.gate_proj / up_proj.
EXPERTS_LAYOUT = "gate_up"


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    merge_qkv: bool
    merge_gate_up: bool
    initializer_range: float
    attn_implementation: str | None
    # MoE (qwen3_moe only; zero / empty on dense models)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_scoring: str = "softmax"
    shared_expert_intermediate_size: int = 0  # > 0: a Qwen2-MoE-style gated shared expert
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    router_expert_bias: bool = False  # DeepSeek-V3's auxiliary-loss-free balancing bias
    router_bias_update_rate: float = 1e-3
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # FP8 recipe of the projections (train.fp8, a compute choice, not part of the checkpoint):
    # "none", "tensorwise", "rowwise" or "blockwise" (xorl/nn/linear.py, xorl_kernels/fp8).
    fp8: str = "none"

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head of q and k (RMSNorm over head_dim) before RoPE; Llama does not."""
        return self.model_type == "qwen3_moe"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Same rule as transformers' Qwen3MoeDecoderLayer."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        if isinstance(config, ModelSpec):
            return config
        model_type = _get(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        hidden_size = int(config.hidden_size)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(_get(config, "num_key_value_heads", num_heads))
        head_dim = _get(config, "head_dim", None)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads}; "
                    "set head_dim explicitly"
                )
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
            )
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE")
        hidden_act = _get(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; xorl.models uses SwiGLU (silu)")
        kwargs: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            num_experts = int(_get(config, "num_experts", 0))
            top_k = int(_get(config, "num_experts_per_tok", 0))
            if num_experts <= 0:
                raise ValueError(f"num_experts={num_experts}: a qwen3_moe model needs num_experts >= 1")
            if not 1 <= top_k <= num_experts:
                raise ValueError(
                    f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}"
                )
            scoring = _get(config, "router_scoring", "softmax")
            if scoring not in ROUTER_SCORINGS:
                raise ValueError(f"router_scoring={scoring!r} is not supported; use one of {ROUTER_SCORINGS}")
            sparse_step = int(_get(config, "decoder_sparse_step", 1))
            if sparse_step < 1:
                raise ValueError(f"decoder_sparse_step={sparse_step} must be >= 1")
            kwargs = dict(
                num_experts=num_experts,
                num_experts_per_tok=top_k,
                moe_intermediate_size=int(config.moe_intermediate_size),
                norm_topk_prob=bool(_get(config, "norm_topk_prob", False)),
                router_scoring=scoring,
                shared_expert_intermediate_size=int(_get(config, "shared_expert_intermediate_size", 0)),
                router_aux_loss_coef=float(_get(config, "router_aux_loss_coef", 0.0)),
                router_z_loss_coef=float(_get(config, "router_z_loss_coef", 0.0)),
                router_expert_bias=bool(_get(config, "router_expert_bias", False)),
                router_bias_update_rate=float(_get(config, "router_bias_update_rate", 1e-3)),
                decoder_sparse_step=sparse_step,
                mlp_only_layers=tuple(int(i) for i in _get(config, "mlp_only_layers", ())),
            )
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(config.intermediate_size),
            num_hidden_layers=int(config.num_hidden_layers),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(config),
            max_position_embeddings=int(_get(config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
            attention_bias=bool(_get(config, "attention_bias", False)),
            mlp_bias=bool(_get(config, "mlp_bias", False)),
            merge_qkv=bool(_get(config, "merge_qkv", False)),
            merge_gate_up=bool(_get(config, "merge_gate_up", False)),
            initializer_range=float(_get(config, "initializer_range", 0.02)),
            attn_implementation=_get(config, "attn_implementation", None),
            **kwargs,
        )
