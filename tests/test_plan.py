"""xorl-plan end to end: the worked example, the ranking's rules, --write-config, HF folders, bad input.

The exact byte counts per rank are checked against the real sharded model in test_plan_memory.py;
here the references are the published worked example, xorl's own validate_config / load_config
(what xorl-train runs), transformers' configs, and the 6N FLOPs rule.
"""

from __future__ import annotations

import json
import os

import pytest

from xorl.cli.plan import main
from xorl.config import Config, load_config
from xorl.distributed.parallel_config import PARALLEL_FIELD_NAMES
from xorl.mfu import flops_per_token
from xorl.planner.guide import Options, evaluate, with_layout
from xorl.planner.memory import model_shapes
from xorl.planner.source import read_model_source
from xorl.planner.step_time import Hardware, step_time

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
LLAMA_8B = os.path.join(EXAMPLES, "llama3_8b_fsdp.yaml")


def _plan_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _first_memory(out: dict) -> dict:
    return out["candidates"][0]["memory_per_gpu_bytes"]


def test_worked_example_70b(capsys):
    # fp16 weights and gradients, 4 optimizer bytes per parameter, plain data parallel (the published table).
    layout = "tensor_parallel_size=4,pipeline_parallel_size=4,data_parallel_mode=ddp"
    mem = _first_memory(_plan_json(capsys, "70B", "--gpus", "64", "--layout", layout, "--precision", "fp16"))
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (8.75e9, 8.75e9, 17.50e9)
    mem = _first_memory(_plan_json(capsys, "70B", "--gpus", "1", "--layout", "data_parallel_mode=none",
                                   "--precision", "fp16"))
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (140e9, 140e9, 280e9)


def _assert_runnable(layout: dict, base: Config, gpus: int) -> Config:
    fields = {k: v for k, v in layout.items() if k in PARALLEL_FIELD_NAMES or k == "activation_checkpointing"}
    config = with_layout(base, fields)
    config.validate(gpus)  # what xorl-train checks before starting
    return config


def test_ranking_lists_only_runnable_layouts_and_recommends_fsdp_alone_when_it_fits(capsys):
    out = _plan_json(capsys, LLAMA_8B, "--gpus", "16", "--gpus-per-node", "8")
    base, candidates = load_config(LLAMA_8B), out["candidates"]
    assert len(candidates) > 10
    for c in candidates:
        _assert_runnable(c["layout"], base, 16)
        assert c["layout"]["tensor_parallel_size"] <= 8  # TP never leaves a node
        mem = c["memory_per_gpu_bytes"]
        assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    fits = [c["fits"] for c in candidates]
    assert fits == sorted(fits, reverse=True)  # everything that fits comes first
    first = candidates[0]["layout"]
    # 8B fits with FSDP2 alone (here HSDP: a node per FSDP group, cheaper than FSDP over IB)
    assert candidates[0]["fits"] and first["data_parallel_replicate_size"] * first["data_parallel_shard_size"] == 16
    assert all(first[k] == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "ringattn_parallel_size",
                                        "ulysses_parallel_size"))
    others = [c for c in candidates[1:] if c["layout"]["tensor_parallel_size"] > 1]
    assert others and all("FSDP2 alone fits" in c["warnings"][0] for c in others)


def test_long_context_needs_context_parallelism(capsys):
    out = _plan_json(capsys, LLAMA_8B, "--gpus", "8", "--seq-len", "131072")
    first = out["candidates"][0]
    assert first["fits"]
    assert first["layout"]["ringattn_parallel_size"] * first["layout"]["ulysses_parallel_size"] >= 4


def test_moe_scales_with_expert_parallelism(capsys):
    out = _plan_json(capsys, os.path.join(EXAMPLES, "qwen3_30b_a3b_pp2_ep8_cp4.yaml"), "--gpus", "16")
    first = out["candidates"][0]["layout"]
    assert out["candidates"][0]["fits"]
    assert first["tensor_parallel_size"] == 1 and first["expert_parallel_size"] >= 8


def test_write_config_is_accepted_by_the_trainer(capsys, tmp_path):
    path = str(tmp_path / "plan.yaml")
    out = _plan_json(capsys, LLAMA_8B, "--gpus", "16", "--write-config", path)
    written = load_config(path, [])
    written.validate(16)
    assert "# world_size: 16" in open(path).read()
    for key, value in out["candidates"][0]["layout"].items():
        assert getattr(written.train, key) == value, key
    assert written.model == load_config(LLAMA_8B).model


def test_step_time_compute_follows_the_6n_rule():
    # Roofline compute at the peak vs the 6N + attention FLOPs estimate (xorl/mfu.py): above it by the
    # element-wise and memory-bound work the roofline adds (about a quarter for an 8B layer at 8K).
    config = with_layout(load_config(LLAMA_8B), {"activation_checkpointing": False, "data_parallel_shard_size": 8})
    hw = Hardware()
    t = step_time(config, _parallel(config, 8), model_shapes(config.model), hw)
    tokens = config.train.gradient_accumulation_steps * config.data.seq_len * 8
    ideal = flops_per_token(config.model, config.data.seq_len) * tokens / 8 / (hw.peak_tflops * 1e12)
    assert 1.1 <= t.compute / ideal <= 1.35, t.compute / ideal


def _parallel(config, gpus):
    from xorl.distributed.parallel_config import ParallelConfig

    return ParallelConfig.from_config(config, gpus)


def test_checkpointing_trades_memory_for_time():
    config = load_config(LLAMA_8B)
    opts = Options(8)
    on, off = (evaluate(with_layout(config, {"activation_checkpointing": ac}), opts) for ac in (True, False))
    assert on.memory.activations < off.memory.activations and on.time.compute > off.time.compute
    assert (on.memory.params, on.memory.grads, on.memory.optimizer) == (off.memory.params, off.memory.grads,
                                                                        off.memory.optimizer)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_hf_folder_reads_config_json(tmp_path, family, capsys):
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        hf = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, rope_theta=5e5,
                                      max_position_embeddings=2048)
    else:
        hf = transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         mlp_only_layers=[0], max_position_embeddings=2048)
    hf.save_pretrained(tmp_path)
    model = read_model_source(str(tmp_path)).config.model
    assert model.model_type == family and model.model_path == str(tmp_path)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings"):
        assert getattr(model, name) == getattr(hf, name), name
    if family == "qwen3_moe":
        assert (model.num_experts, model.num_experts_per_tok, model.mlp_only_layers) == (8, 2, [0])
    out = _plan_json(capsys, str(tmp_path), "--gpus", "4", "--layout", "tensor_parallel_size=2,sequence_parallel=true")
    assert out["candidates"][0]["layout"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize("argv, message", [
    (["70B", "--gpus", "0", "--layout"], "--gpus=0 must be > 0"),
    (["/no/such/model", "--gpus", "8"], "MODEL='/no/such/model'"),
    (["70B", "--gpus", "8"], "is a parameter count"),
    ([LLAMA_8B, "--gpus", "8", "--layout", "tensor_parallel_sise=2"], "did you mean 'tensor_parallel_size'"),
    ([LLAMA_8B, "--gpus", "8", "--layout", "tensor_parallel_size"], "must be field=value"),
    ([LLAMA_8B, "--gpus", "16", "--layout", "tensor_parallel_size=16"], "spans nodes of 8 GPUs"),
    ([LLAMA_8B, "--gpus", "8", "--global-batch-tokens", "1000", "--layout"], "--global-batch-tokens=1000"),
])
def test_bad_input_is_one_clean_message(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unsupported_hf_model_type_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "hidden_size": 64}))
    assert main([str(tmp_path), "--gpus", "8"]) == 2
    assert "model_type='gpt_oss'" in capsys.readouterr().err


@pytest.mark.parametrize("cls_name, fields", [
    ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    ("Glm4MoeForCausalLM", dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
                                first_k_dense_replace=1, head_dim=32)),
    ("Qwen2ForCausalLM", {}),
])
def test_hf_folder_of_every_family_has_transformers_parameter_count(tmp_path, cls_name, fields):
    """The planner reads a family's config.json as xorl-train does, and counts its parameters exactly."""
    import torch

    from xorl.planner.memory import model_shapes

    transformers = pytest.importorskip("transformers")
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    hf = config_cls(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, **fields)
    hf.save_pretrained(tmp_path)
    model = read_model_source(str(tmp_path)).config.model
    with torch.device("meta"):
        count = sum(p.numel() for p in getattr(transformers, cls_name)(hf).parameters())
    assert model_shapes(model).num_params == count


def test_fsdp_alone_is_not_forced_when_it_is_much_slower(capsys):
    # 30B on two nodes: FSDP2 alone fits, but every layer's all-gather crosses IB; TP x PP wins.
    out = _plan_json(capsys, os.path.join(EXAMPLES, "llama_30b_fsdp_pp2.yaml"), "--gpus", "16")
    first = out["candidates"][0]["layout"]
    assert first["tensor_parallel_size"] > 1 or first["pipeline_parallel_size"] > 1
    simple = [c for c in out["candidates"] if c["fits"] and c["layout"]["tensor_parallel_size"] == 1
              and c["layout"]["pipeline_parallel_size"] == 1]
    assert simple and min(c["step_time_s"] for c in simple) > 1.4 * out["candidates"][0]["step_time_s"]
