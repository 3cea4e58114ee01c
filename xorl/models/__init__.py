"""HF-compatible Llama-style dense and Qwen3-MoE-style models, and HF safetensors IO."""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "build_model": ".registry",
    "to_hf_config_dict": ".registry",
    "ModelSpec": ".spec",
    "CausalLMOutput": ".decoder",
    "LlamaForCausalLM": ".llama",
    "Qwen3MoeForCausalLM": ".qwen3_moe",
    "LocalAttention": ".attention",
    "load_hf_weights": ".hf_io",
    "save_hf_weights": ".hf_io",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
