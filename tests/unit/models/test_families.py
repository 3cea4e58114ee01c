"""Every family against transformers' own class.

For each family: a tiny random checkpoint that transformers' class writes (save_pretrained) loads
through ``xorl.models.from_pretrained`` and gives transformers' logits (fp32, eager attention,
weights drawn so activations are O(1)), also at positions far past RoPE scaling's
original_max_position_embeddings; our ``save_pretrained`` folder loads back in transformers with
the same logits. For each family's published full-size config, ``from_pretrained(folder with only
config.json, weights=False)`` on the meta device has exactly transformers' parameter count.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import xorl.models  # noqa: E402
from xorl.models.registry import to_hf_config_dict  # noqa: E402

TOL = 1e-5
SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

MLA = dict(num_key_value_heads=6, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
           n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
           first_k_dense_replace=1)
MLA_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

# name -> (transformers class name, config class name, config fields beyond SMALL)
FAMILIES = {
    "llama3.1-rope-llama3": ("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "llama3.2-tied-linear": ("LlamaForCausalLM", "LlamaConfig", dict(
        tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})),
    "llama-yarn": ("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(head_dim=12, sliding_window=None)),
    # Mistral 7B v0.1's kind: every layer a window (5) shorter than the sequence (24).
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(head_dim=12, sliding_window=5)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=6, num_experts_per_tok=3)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, head_dim=16)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        attention_bias=True, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.5})),
    # MLA (q.k head 12 + 8, v head 10, so d_v != d_qk), YaRN with mscale_all_dim (the softmax scale's
    # factor), interleaved RoPE pairs, 4 groups of 2 experts with the selection bias, a dense first layer.
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        MLA, q_lora_rank=20, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=MLA_YARN)),
    "deepseek_v3-no-q_lora": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        MLA, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False,
        attention_bias=True)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        MLA, q_lora_rank=20, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0,
        rope_parameters=MLA_YARN)),
    "deepseek_v2-lite-greedy": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        MLA, q_lora_rank=None, topk_method="greedy")),
    # A window (5) shorter than the sequence (24), random sinks and biases (randomize_), a swiglu_limit
    # low enough that the clamps cut, a non-default alpha, YaRN past its original length (32).
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        num_local_experts=5, num_experts_per_tok=2, head_dim=16, sliding_window=5, swiglu_limit=0.8,
        swiglu_alpha=1.3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.3^2), biases and GLM's
    selection bias ~ N(0, 0.3^2) (so group-limited routing is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if "norm" in name:
            p.copy_(1 + 0.3 * noise)
        elif p.dim() == 1:
            p.copy_(0.3 * noise)
        elif p.dim() == 3:  # transformers v5 fused experts [E, out, in]
            p.copy_(noise * p.shape[-1] ** -0.5)
        else:
            p.copy_(noise * p.shape[-1] ** -0.5)


def _swiglu_fields_as_transformers_computes(config) -> None:
    """Some transformers releases (5.17, the GPU image's) hard-code gpt-oss's SwiGLU alpha 1.702 and
    limit 7.0 in GptOssExperts and ignore the config's; there the saved config states what that
    transformers computes, so xorl (which reads the config) is compared on the same formula. Clamping
    at other limits is then checked only where transformers reads them (5.24, CI's)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(config)
    config.swiglu_alpha, config.swiglu_limit = experts.alpha, experts.limit


def hf_checkpoint(name: str, folder, seed: int = 0, **overrides):
    cls_name, config_name, fields = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**SMALL, **fields, **overrides}, attn_implementation="eager")
    if name == "gpt_oss":
        _swiglu_fields_as_transformers_computes(config)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    randomize_(model, seed)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers_and_round_trips(name, tmp_path):
    hf = hf_checkpoint(name, tmp_path / "hf", seed=1)
    ours = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="sdpa").eval()
    assert ours.spec.model_type == hf.config.model_type
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=gen)
    # Positions past original_max_position_embeddings (16 / 32 here), as a context-parallel rank sees them.
    positions = torch.arange(100, 124).expand(2, 24)
    with torch.no_grad():
        for position_ids in (None, positions):
            ref = hf(input_ids=input_ids, position_ids=position_ids).logits
            out = ours(input_ids, position_ids=position_ids).logits
            assert rel_err(out, ref) < TOL, (name, position_ids is None)

        xorl.models.save_pretrained(ours, str(tmp_path / "ours"))
        back = getattr(transformers, FAMILIES[name][0]).from_pretrained(
            tmp_path / "ours", attn_implementation="eager").eval()
        assert rel_err(back(input_ids=input_ids).logits, ref_plain := hf(input_ids=input_ids).logits) < TOL
        again = xorl.models.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
        assert rel_err(again(input_ids).logits, ref_plain) < TOL


def test_glm_routing_is_group_limited_and_scaled(tmp_path):
    """The router picks only inside the chosen groups and scales the renormalised weights."""
    hf = hf_checkpoint("glm4_moe", tmp_path / "hf", seed=3)
    ours = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert ours.model.layers[0].mlp.__class__.__name__ == "SwiGLUMLP"  # first_k_dense_replace=1
    gate = ours.model.layers[1].mlp.gate
    x = torch.randn(64, SMALL["hidden_size"], generator=torch.Generator().manual_seed(4))
    routed = gate(x)
    ref_logits, ref_weights, ref_ids = hf.model.layers[1].mlp.gate(x)
    assert torch.equal(routed.expert_ids.sort(-1).values, ref_ids.sort(-1).values)
    order_ours, order_ref = routed.expert_ids.argsort(-1), ref_ids.argsort(-1)
    assert rel_err(routed.weights.gather(1, order_ours), ref_weights.gather(1, order_ref)) < TOL
    assert torch.allclose(routed.weights.sum(-1), torch.full((64,), 2.5))
    groups = routed.expert_ids // 2  # 8 experts in 4 groups of 2, topk_group=2
    assert all(len(set(row.tolist())) <= 2 for row in groups)


# Published config.json values (the model cards), the fields that decide the parameter count.
PUBLISHED = {
    "Llama-3.1-8B": ("LlamaForCausalLM", dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}), 8_030_261_248),
    "Llama-3.2-1B": ("LlamaForCausalLM", dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}), 1_235_814_400),
    "Qwen2.5-7B": ("Qwen2ForCausalLM", dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, sliding_window=131072, use_sliding_window=False, max_window_layers=28,
        tie_word_embeddings=False), 7_615_616_512),
    "Qwen3-8B": ("Qwen3ForCausalLM", dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None), 8_190_735_360),
    "Mistral-7B-v0.3": ("MistralForCausalLM", dict(
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False), 7_248_023_552),
    "Mixtral-8x7B": ("MixtralForCausalLM", dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        router_aux_loss_coef=0.02, tie_word_embeddings=False), 46_702_792_704),
    "OLMoE-1B-7B": ("OlmoeForCausalLM", dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, norm_topk_prob=False, clip_qkv=None,
        router_aux_loss_coef=0.01, tie_word_embeddings=False), None),
    "GLM-4.5-Air": ("Glm4MoeForCausalLM", dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5,
        attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000.0,
        use_qk_norm=False, num_nextn_predict_layers=1, tie_word_embeddings=False), None),
    # The hub file as released (v4 rope_scaling "type"; scoring_func / topk_method are informational
    # there, transformers ignores them; no rope_interleave key: its default, true).
    "DeepSeek-V3": ("DeepseekV3ForCausalLM", dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=3, moe_layer_freq=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        num_nextn_predict_layers=1, attention_bias=False, tie_word_embeddings=False), None),
    "DeepSeek-V2-Lite": ("DeepseekV2ForCausalLM", dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy",
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000, rope_scaling={
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "type": "yarn"}, tie_word_embeddings=False), None),
    # The released config.json (MXFP4 experts: quantization_config), model card: 116.83B / 20.91B parameters.
    "gpt-oss-120b": ("GptOssForCausalLM", dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        experts_per_token=4, attention_bias=True, sliding_window=128, swiglu_limit=7.0, initial_context_length=4096,
        layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=150000, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096},
        router_aux_loss_coef=0.9, tie_word_embeddings=False, quantization_config={
            "quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}),
        116_829_156_672),
    "gpt-oss-20b": ("GptOssForCausalLM", dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        attention_bias=True, sliding_window=128, swiglu_limit=7.0, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=150000, rope_scaling={
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}, tie_word_embeddings=False), 20_914_757_184),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_has_transformers_parameter_count(name, tmp_path):
    cls_name, fields, published = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [cls_name], "hidden_act": "silu", **fields}))
    with torch.device("meta"):
        ours = xorl.models.from_pretrained(str(tmp_path), weights=False)
        hf = getattr(transformers, cls_name)(transformers.AutoConfig.from_pretrained(tmp_path))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters())
    if published is not None:
        assert count == published


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layer_in_the_files_is_skipped(name, tmp_path, caplog):
    """GLM-4.5 and DeepSeek-V3 files hold their MTP layer after the last layer (num_nextn_predict_layers);
    transformers does not build it, nor do we, and loading skips its tensors (saying so in one line)
    instead of calling them unexpected."""
    from safetensors.torch import load_file, save_file

    hf = hf_checkpoint(name, tmp_path / "hf", seed=5)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    extra = SMALL["num_hidden_layers"]  # the layer after the last
    tensors[f"model.layers.{extra}.eh_proj.weight"] = torch.randn(8, 8)
    tensors[f"model.layers.{extra}.mlp.experts.0.gate_proj.weight"] = torch.randn(8, 8)
    save_file(tensors, path, metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="xorl.models.hf_reader"):
        ours = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and f"model.layers.{extra}" in skipped[0], skipped
    input_ids = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert rel_err(ours(input_ids).logits, hf(input_ids=input_ids).logits) < TOL


def test_hub_style_config_json_loads_through_the_run_config(tmp_path):
    """A config.json as the hub ships Llama-3.1 (transformers v4 keys: rope_theta, rope_scaling with
    rope_type) fills the run config, and a dynamic one, or a Qwen2 one with its sliding windows on, is
    refused naming the field."""
    from xorl.config import ConfigError, load_config

    fields = dict(PUBLISHED["Llama-3.1-8B"][1], architectures=["LlamaForCausalLM"], hidden_act="silu",
                  bos_token_id=128000, eos_token_id=[128001, 128008, 128009])
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = load_config(None, [f"--model.model_path={tmp_path}"])
    assert config.model.rope_scaling["rope_type"] == "llama3" and config.model.rope_theta == 500000.0
    assert config.model.max_position_embeddings == 131072
    fields["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is refused: dynamic NTK"):
        load_config(None, [f"--model.model_path={tmp_path}"])
    qwen = dict(PUBLISHED["Qwen2.5-7B"][1], use_sliding_window=True)
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    with pytest.raises(ConfigError, match="use_sliding_window=true: sliding-window attention is not supported yet"):
        load_config(None, [f"--model.model_path={tmp_path}"])


def test_mistral_sliding_window_is_read_as_transformers_reads_it(tmp_path):
    """Mistral 7B v0.1's window (4096, every layer) loads; a file without the key gets MistralConfig's
    default 4096, as transformers builds it; null is full attention; export writes the window back."""
    from xorl.config import load_config
    from xorl.observability.mfu import keys_per_query

    mistral = dict(PUBLISHED["Mistral-7B-v0.3"][1])
    for value, expected in ((4096, 4096), (None, None), ("absent", 4096)):
        fields = {k: v for k, v in mistral.items() if k != "sliding_window"}
        if value != "absent":
            fields["sliding_window"] = value
        (tmp_path / "config.json").write_text(json.dumps(fields))
        assert transformers.AutoConfig.from_pretrained(tmp_path).sliding_window == expected
        config = load_config(None, [f"--model.model_path={tmp_path}"])
        assert config.model.sliding_window == expected, value
        assert to_hf_config_dict(config.model)["sliding_window"] == expected
        # MFU / the planner count the keys a query sees: the window on all 32 layers (3072 at 8K).
        keys = 32 * (3072 if expected else 4096)
        assert keys_per_query(config.model, 8192) == keys


@pytest.mark.parametrize("name", ["mixtral", "glm4_moe"])
def test_sharded_start_from_a_family_folder_reads_its_weights(name, gloo_world, tmp_path):
    """FSDP 2 x EP 2 ranks start from the folder (each reading its own boxes, through the family's
    file names: Mixtral's block_sparse_moe.experts.{j}.w1, GLM's shared_experts) with exactly the
    weights one process loads."""
    from tests.support.parity_runs import initial_weights
    from xorl.config import load_config

    experts = {"num_local_experts": 4} if name == "mixtral" else {}
    hf_checkpoint(name, tmp_path / "hf", seed=7, vocab_size=272, **experts)
    one = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    config = load_config(None, [f"--model.model_path={tmp_path / 'hf'}", f"--train.output_dir={tmp_path / 'run'}",
                                "--train.data_parallel_shard_size=2", "--train.expert_parallel_size=2",
                                "--data.seq_len=32", "--data.micro_batch_size=1"])
    loaded = gloo_world(2).run(initial_weights, config)[0]
    assert loaded.keys() == one.keys()
    assert all(torch.equal(loaded[k], one[k]) for k in one), [k for k in one if not torch.equal(loaded[k], one[k])]


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="deepseek_v3", head_dim=64), "head_dim=64: deepseek_v3's q.k head dim is qk_nope_head_dim"),
    (dict(model_type="deepseek_v3", num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads"),
    (dict(model_type="deepseek_v3", merge_qkv=True), "merge_qkv=true: deepseek_v3's latent attention"),
    (dict(model_type="deepseek_v3", qk_rope_head_dim=5), "qk_rope_head_dim=5 must be even"),
    (dict(model_type="llama", num_experts=0),
     "v_head_dim: latent attention fields, but model_type=.llama."),
])
def test_bad_latent_attention_config_is_refused_naming_the_field(fields, message):
    from xorl.models.spec import ModelSpec

    base = dict(model_type="deepseek_v3", vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelSpec.from_config(types.SimpleNamespace(**{**base, **fields}))


@pytest.mark.parametrize("change, message", [
    (dict(norm_topk_prob=True), "norm_topk_prob=True; DeepseekV2ForCausalLM always has False"),
    (dict(topk_method="noaux_tc"), "topk_method='noaux_tc': DeepseekV2ForCausalLM routes with one of"),
])
def test_deepseek_v2_router_that_transformers_does_not_run_is_refused(change, message, tmp_path):
    cls_name, fields, _ = PUBLISHED["DeepSeek-V2-Lite"]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [cls_name], "hidden_act": "silu", **fields,
                                                      **change}))
    with pytest.raises(ValueError, match=message):
        xorl.models.from_pretrained(str(tmp_path), weights=False)


def test_deepseek_v2_group_limited_routing_ranks_groups_by_their_best_score(tmp_path):
    """V2's group_limited_greedy: softmax scores, a group ranked by its best expert (not V3's top-2 sum),
    weights times routed_scaling_factor, not renormalised: the same experts and weights as transformers."""
    hf = hf_checkpoint("deepseek_v2", tmp_path / "hf", seed=8)
    ours = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    gate = ours.model.layers[1].mlp.gate
    assert gate.group_score == "max" and gate.e_score_correction_bias is None
    x = torch.randn(256, SMALL["hidden_size"], generator=torch.Generator().manual_seed(9))
    routed = gate(x)
    _, ref_weights, ref_ids = hf.model.layers[1].mlp.gate(x)
    assert torch.equal(routed.expert_ids.sort(-1).values, ref_ids.sort(-1).values)
    order_ours, order_ref = routed.expert_ids.argsort(-1), ref_ids.argsort(-1)
    assert rel_err(routed.weights.gather(1, order_ours), ref_weights.gather(1, order_ref)) < TOL
    # Some token's groups differ between "best score" and "top-2 sum" ranking, so the test can tell them apart.
    gate.group_score = "top2_sum"
    assert not torch.equal(gate(x).expert_ids.sort(-1).values, routed.expert_ids.sort(-1).values)


def _fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv per block, their dequantised product) as DeepSeek's release stores them."""
    rows, cols = (-(-n // block) for n in w.shape)
    padded = torch.zeros(rows * block, cols * block)
    padded[:w.shape[0], :w.shape[1]] = w
    blocks = padded.view(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
    q = (w / expanded).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


def test_fp8_block_quantised_release_folder_loads_dequantised(tmp_path):
    """A folder as DeepSeek-V3 ships (per-expert projections, every projection float8 e4m3 with a
    weight_scale_inv per block, quantization_config in config.json) loads dequantised box by box:
    transformers' model holding the dequantised weights gives our logits; any box equals the slice."""
    from safetensors.torch import load_file, save_file

    from xorl.models.fp8_blocks import dequantize_box

    block = 8  # 48 x 20, 16 x 48, ...: partial blocks at the edges
    hf = hf_checkpoint("deepseek_v3", tmp_path / "hf", seed=11)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = tensors.pop(name)  # transformers 5's fused experts -> the release's per-expert tensors
        prefix = name.rsplit(".", 1)[0]
        for j, w in enumerate(stacked):
            if name.endswith("gate_up_proj"):
                tensors[f"{prefix}.{j}.gate_proj.weight"], tensors[f"{prefix}.{j}.up_proj.weight"] = w.chunk(2)
            else:
                tensors[f"{prefix}.{j}.down_proj.weight"] = w
    dequantised = {}
    for name in [n for n in tensors if n.endswith("proj.weight") or n.endswith("proj_with_mqa.weight")]:
        q, scale, dequantised[name] = _fp8_blocks(tensors[name], block)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    state = hf.state_dict()
    for name, w in dequantised.items():
        if ".experts." not in name:
            state[name] = w
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        prefix = key.rsplit(".", 1)[0]
        n = state[key].shape[0]
        if key.endswith("gate_up_proj"):
            state[key] = torch.stack([torch.cat([dequantised[f"{prefix}.{j}.gate_proj.weight"],
                                                 dequantised[f"{prefix}.{j}.up_proj.weight"]]) for j in range(n)])
        else:
            state[key] = torch.stack([dequantised[f"{prefix}.{j}.down_proj.weight"] for j in range(n)])
    hf.load_state_dict(state)
    ours = xorl.models.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="sdpa")
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        assert rel_err(ours(input_ids).logits, hf(input_ids=input_ids).logits) < TOL

    name = "model.layers.1.self_attn.q_b_proj.weight"
    q, scale = tensors[name], tensors[name + "_scale_inv"]
    stored = {name: q, name + "_scale_inv": scale}
    gen = torch.Generator().manual_seed(13)
    for _ in range(20):
        r0, c0 = (int(torch.randint(0, n, (), generator=gen)) for n in q.shape)
        r1, c1 = (int(torch.randint(lo + 1, n + 1, (), generator=gen)) for lo, n in zip((r0, c0), q.shape))
        box = dequantize_box(lambda k, i: stored[k][i], name, name + "_scale_inv", (slice(r0, r1), slice(c0, c1)),
                             tuple(q.shape), (block, block))
        assert torch.equal(box, dequantised[name][r0:r1, c0:c1])


def test_mfu_flops_of_latent_attention_count_its_projection_weights():
    """xorl/observability/mfu.py: for MLA the 6 N term counts the low-rank projections the model holds (not a
    192-wide q/k/v/o), and the scores term 6 (d_qk + d_v) per key and head."""
    from xorl.config import ModelConfig
    from xorl.models.registry import build_model
    from xorl.observability.mfu import flops_per_token

    config = ModelConfig(model_type="deepseek_v3", vocab_size=97, hidden_size=48, intermediate_size=40,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=20, kv_lora_rank=12,
                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    model = build_model(config)
    attn = sum(p.numel() for n, p in model.named_parameters() if ".self_attn." in n and p.ndim == 2)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    router = sum(p.numel() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    matmul = attn + router + experts * 2 / 8 + model.lm_head.weight.numel()
    seq = 32
    scores = 6 * 2 * 4 * (12 + 6) * seq / 2
    assert flops_per_token(config, seq) == pytest.approx(6 * matmul + scores, rel=1e-12)


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe", "gpt_oss"])
def test_expert_width_the_family_takes_from_intermediate_size_is_not_silently_replaced(model_type, tmp_path):
    """Mixtral / OLMoE / gpt-oss size their experts as intermediate_size: a config that sets
    moe_intermediate_size to another value is refused, naming the field, before any process starts
    (it used to be replaced without a word); the same value, or leaving it out, is accepted."""
    from xorl.config import load_config
    from xorl.config.errors import ConfigError
    from xorl.config.validate import validate_config

    def config(*extra):
        return load_config(None, [f"--model.model_type={model_type}", "--model.num_experts=4",
                                  "--model.intermediate_size=96", f"--train.output_dir={tmp_path}", *extra])

    with pytest.raises(ConfigError, match=r"model.moe_intermediate_size=32: model_type='.*' sizes it as "
                                          r"intermediate_size \(96\); remove model.moe_intermediate_size"):
        validate_config(config("--model.moe_intermediate_size=32"), 1)
    for ok in (config("--model.moe_intermediate_size=96"), config()):
        validate_config(ok, 1)


def test_olmoe_tensor_parallel_run_from_a_folder_exports_one_process_weights(gloo_world, tmp_path):
    """OLMoE's width q/k norm under TP 2 + SP (its weight split with the heads, merge_qkv's grouped
    rows): started from a transformers-written folder (random norm weights), 3 steps, exported; the
    losses and the export (read back by transformers) are one process's from the same folder."""
    from tests.support.parity_runs import max_rel_diff, train_export_and_report, weights_rel_diff
    from xorl.config import load_config

    hf_checkpoint("olmoe", tmp_path / "hf", seed=5, vocab_size=272)

    def run(out: str, world: int, *extra: str) -> tuple[list[float], dict]:
        config = load_config(None, [
            f"--model.model_path={tmp_path / 'hf'}", f"--train.output_dir={tmp_path / out}", "--model.merge_qkv=true",
            "--data.seq_len=32", "--data.micro_batch_size=1", "--train.max_steps=3", "--train.lr=3e-3",
            "--train.gradient_accumulation_steps=2", "--train.save_steps=0", "--train.export_hf=true",
            "--train.data_parallel_shard_size=1", *extra])
        losses = gloo_world(world).run(train_export_and_report, config)[0]["losses"]
        folder = tmp_path / out / "hf"
        return losses, transformers.OlmoeForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()

    one_losses, one = run("one", 1)
    tp_losses, tp = run("tp", 2, "--train.tensor_parallel_size=2", "--train.sequence_parallel=true")
    assert max_rel_diff(tp_losses, one_losses) <= 1e-5, (tp_losses, one_losses)
    assert weights_rel_diff(tp, one) <= 1e-5
    for name in ("q_norm", "k_norm"):  # the norm weights moved from the folder's random values, alike
        key = f"model.layers.0.self_attn.{name}.weight"
        assert rel_err(tp[key], one[key]) <= 1e-5 and one[key].std() > 0.1


@pytest.mark.parametrize("model", ["qwen3", "mistral", "glm4_moe", "deepseek_v3"])
def test_dense_mlp_width_not_dividing_tp_is_refused_before_start(model):
    """Dense families and the dense first layers of GLM / DeepSeek split intermediate_size over TP: a
    width TP does not divide is a config error naming the field (not an error once groups exist)."""
    from tests.support.parity_runs import MODELS, tiny_config
    from xorl.config import ConfigError, validate_config

    overrides = MODELS.get(model, dict(model_type=model))
    config = tiny_config("/tmp/unused", "llama", data_parallel_shard_size=1, tensor_parallel_size=2)
    for key, value in {**overrides, "intermediate_size": 63}.items():
        setattr(config.model, key, value)
    with pytest.raises(ConfigError, match="intermediate_size=63 must be a multiple of train.tensor_parallel_size=2"):
        validate_config(config, 2)


def test_olmoe_saved_under_tensor_parallel_resumes_under_fsdp(gloo_world, tmp_path):
    """OLMoE saved by TP 2 + SP ranks (each holding its block of the width q/k norms, Shard(0)) and
    resumed with FSDP over the same 2 ranks logs an uninterrupted FSDP run's losses."""
    from tests.support.parity_runs import max_rel_diff, tiny_config, train_losses

    fsdp2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)
    tp2 = dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True,
               gradient_accumulation_steps=4)
    world = gloo_world(2)
    full = world.run(train_losses, tiny_config(str(tmp_path / "full"), "olmoe", max_steps=6, **fsdp2))[0]
    run = str(tmp_path / "tp")
    first = world.run(train_losses, tiny_config(run, "olmoe", max_steps=6, save_steps=3, **tp2), 3)[0]
    resumed = world.run(train_losses, tiny_config(run, "olmoe", max_steps=6, resume=True, **fsdp2))[0]
    assert len(first) == len(resumed) == 3
    assert max_rel_diff(first + resumed, full) <= 1e-5, (first + resumed, full)
