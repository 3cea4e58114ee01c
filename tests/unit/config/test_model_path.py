"""model.model_path: the folder's config.json defines the model (the YAML / CLI may only repeat it), and its
weight files are checked before start-up."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from xorl.config import Config, ConfigError, load_config, validate_config
from xorl.config.model_path import weight_file_problems


def _transformers_llama_folder(tmp_path, **overrides):
    """A config.json written by transformers itself (what users download), with non-default values."""
    transformers = pytest.importorskip("transformers")
    fields = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.01)
    fields.update(overrides)
    config = transformers.LlamaConfig(**fields)
    folder = tmp_path / "llama"
    config.save_pretrained(folder)
    return folder


def test_the_model_folder_fills_every_model_field(tmp_path):
    folder = _transformers_llama_folder(tmp_path)
    config = load_config(None, [f"--model.model_path={folder}"])
    m = config.model
    assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers) == (300, 48, 96, 3)
    assert (m.num_attention_heads, m.num_key_value_heads, m.max_position_embeddings) == (4, 2, 512)
    assert m.rope_theta == 500000.0 and m.rms_norm_eps == 1e-5 and m.tie_word_embeddings is True
    assert m.initializer_range == 0.01
    validate_config(config, 1)


def test_repeating_a_field_is_fine_and_another_value_names_both(tmp_path):
    folder = _transformers_llama_folder(tmp_path)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(f"model:\n  model_path: {folder}\n  rope_theta: 500000.0\n  rms_norm_eps: 1.0e-6\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(yaml_path), ["--model.hidden_size=64", "--model.rope_theta=5e5"])
    message = str(info.value)
    assert message.startswith("invalid config (2 problems)")  # rope_theta repeats the file: no problem
    assert f"model.rms_norm_eps=1e-06 (set by {yaml_path}) conflicts with rms_norm_eps=1e-05 in {folder}" in message
    assert "model.hidden_size=64 (set by --model.hidden_size=64) conflicts with hidden_size=48" in message
    assert "remove model.hidden_size from the config or set it to 48" in message


def test_training_knobs_in_config_json_yield_to_an_explicit_value(tmp_path):
    folder = _transformers_llama_folder(tmp_path)
    config = load_config(None, [f"--model.model_path={folder}", "--model.initializer_range=0.05",
                                "--model.attn_implementation=sdpa"])
    assert config.model.initializer_range == 0.05 and config.model.attn_implementation == "sdpa"


def test_a_config_built_in_code_must_agree_with_the_folder(tmp_path):
    folder = _transformers_llama_folder(tmp_path)
    config = Config()
    config.model.model_path = str(folder)
    with pytest.raises(ConfigError, match="model.hidden_size=64 conflicts with hidden_size=48"):
        validate_config(config, 1)


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_act", "gelu", "hidden_act='gelu'; xorl.models use SwiGLU (silu) only"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is refused: dynamic NTK rescales"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_type='longrope' is not supported"),
    ("mlp_bias", True, "mlp_bias=true is not supported"),
    ("model_type", "mamba", "model_type='mamba' is not one of ['llama', 'qwen2', 'qwen3', 'mistral'"),
    ("sliding_window", 4096, "sliding_window=4096: sliding-window attention is not supported yet"),
])
def test_features_xorl_cannot_build_are_refused_naming_the_file(tmp_path, field, value, expected):
    folder = _transformers_llama_folder(tmp_path)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--model.model_path={folder}"])
    assert str(path) in str(info.value) and expected in str(info.value)


def _transformers_deepseek_v3_folder(tmp_path):
    """A DeepSeek-V3 config.json from transformers: its q.k head dim (12 + 8) is not hidden_size // heads (12)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=48, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_group=1, topk_group=1,
        first_k_dense_replace=1)
    folder = tmp_path / "dsv3"
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("folder_of", ["deepseek_v3", "qwen3"])
def test_head_dim_null_is_unset_not_a_conflict_with_the_folder(tmp_path, folder_of):
    """``head_dim: null`` means "derive it": with a folder it sets nothing, in the YAML or on the CLI
    (the folder's head dim, 20 for the latent attention here, or Qwen3's 16 against 48 // 4 = 12)."""
    if folder_of == "deepseek_v3":
        folder, expected = _transformers_deepseek_v3_folder(tmp_path), 20
    else:
        transformers = pytest.importorskip("transformers")
        folder, expected = tmp_path / "qwen3", 16
        transformers.Qwen3Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16).save_pretrained(folder)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(f"model:\n  model_path: {folder}\n  head_dim: null\n")
    for config in (load_config(str(yaml_path), []),
                   load_config(None, [f"--model.model_path={folder}", "--model.head_dim=null"])):
        validate_config(config, 1)
        from xorl.models.spec import ModelSpec

        assert ModelSpec.from_config(config.model).head_dim == expected
    # Another value still conflicts, naming the folder's.
    with pytest.raises(ConfigError, match=f"conflicts with head_dim={expected} in"):
        load_config(None, [f"--model.model_path={folder}", "--model.head_dim=24"])


def _weights(folder, shards: int = 1) -> dict[str, torch.Tensor]:
    """A folder of random tensors as safetensors (one file, or ``shards`` files and an index)."""
    gen = torch.Generator().manual_seed(7)
    tensors = {f"model.layers.{i}.w": torch.randn(4, 8, generator=gen) for i in range(4)}
    os.makedirs(folder, exist_ok=True)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        return tensors
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


def test_damaged_or_missing_weight_files_are_named(tmp_path):
    one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
    _weights(one)
    _weights(sharded, shards=2)
    assert weight_file_problems(one) == [] and weight_file_problems(sharded) == []

    single = os.path.join(one, "model.safetensors")
    size = os.path.getsize(single)
    os.truncate(single, size - 10)  # a copy cut short in the data
    [problem] = weight_file_problems(one)
    assert f"{single} has {size - 10} bytes, its header describes {size}" in problem
    os.truncate(single, 20)  # cut short inside the header
    [problem] = weight_file_problems(one)
    assert single in problem and "its header alone needs" in problem

    second = os.path.join(sharded, "model-00002-of-00002.safetensors")
    os.remove(second)
    [problem] = weight_file_problems(sharded)
    assert f"{second} is missing (model.safetensors.index.json lists it)" in problem
    save_file({"other": torch.randn(2)}, second)  # a file of another model under the right name
    [problem] = weight_file_problems(sharded)
    assert "places 2 tensors in model-00002-of-00002.safetensors that it does not hold" in problem
