"""HF-compatible decoder families (xorl/models/registry.py), from_pretrained / save_pretrained, HF safetensors IO."""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "build_model": ".registry",
    "from_pretrained": ".pretrained",
    "save_pretrained": ".pretrained",
    "MODEL_TYPES": ".registry",
    "to_hf_config_dict": ".registry",
    "ModelSpec": ".spec",
    "CausalLMOutput": ".decoder",
    "LlamaForCausalLM": ".llama",
    "Qwen3MoeForCausalLM": ".qwen3_moe",
    "LocalAttention": ".attention",
    "load_hf_weights": ".hf_reader",
    "save_hf_weights": ".hf_writer",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
