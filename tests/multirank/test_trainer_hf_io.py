"""The trainer's Hugging Face boundary: export a sharded run, start a run from a local HF folder, MFU."""

import pytest
import torch

from tests.support.parity_runs import initial_weights, tiny_config, train_and_report, train_export_and_report
from xorl.models.registry import build_model
from xorl.observability.mfu import flops_per_token


def test_export_loads_in_transformers_and_starting_from_it_restores_the_weights(gloo_world, tmp_path):
    transformers = pytest.importorskip("transformers")
    world = gloo_world(2)
    fsdp_tp = dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True,
                   gradient_accumulation_steps=2, max_steps=3)
    run = tmp_path / "run"
    world.run(train_export_and_report, tiny_config(str(run), export_hf=True, **fsdp_tp))
    trained = world.run(train_and_report, tiny_config(str(tmp_path / "again"), **fsdp_tp))[0]["weights"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(run / "hf"), torch_dtype=torch.float32).eval()
    hf_state = hf.state_dict()
    for name, value in trained.items():  # the export holds the trained weights, under HF names
        assert torch.equal(hf_state[name], value), name

    # A new run (FSDP over 2 ranks) started from the exported folder begins from exactly those weights.
    start = tiny_config(str(tmp_path / "from_hf"), data_parallel_shard_size=2)
    start.model.model_path = str(run / "hf")
    loaded = world.run(initial_weights, start)[0]
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_flops_per_token_counts_every_matmul_weight_six_times():
    config = tiny_config("/tmp/unused").model
    model = build_model(config)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n)
    seq = 32
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq / 2
    assert flops_per_token(config, seq) == pytest.approx(6 * matmul + attention, rel=1e-12)
