"""The parity matrix's rows for the families it reached last: Qwen2, Mistral, Qwen2-MoE, DeepSeek-V2.

Each family on every layout kind it is accepted on (the config rules refuse none of these for it:
xorl/config/rules/parallel.py), 10 steps against one process with tests/multirank/test_parity_matrix.py's check and
bounds. A third file so that the pytest-xdist workers share the matrix (loadfile: one file, one
worker). What each tiny model turns on: tests/parity_runs.MODELS.
"""

import pytest

from tests.multirank.test_parity_matrix import check_layout, single_process_references

_DENSE_LAYOUTS = {
    "fsdp2": dict(data_parallel_shard_size=2),
    "tp2+sp": dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True),
    "ring2": dict(data_parallel_shard_size=1, ringattn_parallel_size=2),
    "ulysses2": dict(data_parallel_shard_size=1, ulysses_parallel_size=2),
    "pp2": dict(data_parallel_shard_size=1, pipeline_parallel_size=2),
}
# (id, world size, model type, train overrides), as in tests/test_parity_matrix.LAYOUTS.
LAYOUTS = [
    *[(f"qwen2 {name} (q/k/v biases, none on o)", 2, "qwen2", train) for name, train in _DENSE_LAYOUTS.items()],
    ("qwen2 tp2+sp, merge_qkv and merge_gate_up (the q/k/v biases in the fused projection's TP shards)", 2,
     "qwen2-merged", dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True)),
    *[(f"mistral {name} (a sliding window on every layer)", 2, "mistral", train)
      for name, train in _DENSE_LAYOUTS.items()],
    ("mistral ring2 x ulysses2 (the window through both context-parallel kinds)", 4, "mistral",
     dict(data_parallel_shard_size=1, ringattn_parallel_size=2, ulysses_parallel_size=2)),
    ("qwen2_moe ep2 x fsdp2 (gated shared expert, dense first layer)", 2, "qwen2_moe",
     dict(data_parallel_shard_size=2, expert_parallel_size=2)),
    ("qwen2_moe tp2+sp, ep2 over tp (shared expert and its gate under TP)", 2, "qwen2_moe",
     dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2)),
    ("qwen2_moe tp2+sp, experts fsdp over tp", 2, "qwen2_moe",
     dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True)),
    ("qwen2_moe tp2 (no sp), ep2 over tp (each TP rank routes its share of the tokens)", 2, "qwen2_moe",
     dict(data_parallel_shard_size=1, tensor_parallel_size=2, expert_parallel_size=2)),
    ("qwen2_moe ring2, ep2 over ring", 2, "qwen2_moe",
     dict(data_parallel_shard_size=1, ringattn_parallel_size=2, expert_parallel_size=2)),
    ("qwen2_moe ulysses2, ep2 over ulysses", 2, "qwen2_moe",
     dict(data_parallel_shard_size=1, ulysses_parallel_size=2, expert_parallel_size=2)),
    ("qwen2_moe pp2 (the dense layer on stage 0)", 2, "qwen2_moe",
     dict(data_parallel_shard_size=1, pipeline_parallel_size=2)),
    ("deepseek_v2 ep2 x fsdp2 (latent attention, group-limited greedy routing, dense first layer)", 2,
     "deepseek_v2", dict(data_parallel_shard_size=2, expert_parallel_size=2)),
    ("deepseek_v2 tp2+sp, ep2 over tp (latent attention heads split, latents replicated)", 2, "deepseek_v2",
     dict(data_parallel_shard_size=1, tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2)),
    ("deepseek_v2 ring2, ep2 (d_v != d_qk, YaRN past original_max_position_embeddings)", 2, "deepseek_v2",
     dict(data_parallel_shard_size=1, ringattn_parallel_size=2, expert_parallel_size=2)),
    ("deepseek_v2 ulysses2", 2, "deepseek_v2", dict(data_parallel_shard_size=1, ulysses_parallel_size=2)),
    ("deepseek_v2 pp2 (dense first layer on stage 0)", 2, "deepseek_v2",
     dict(data_parallel_shard_size=1, pipeline_parallel_size=2)),
    ("deepseek_v2 pp2 x ep2 x fsdp2", 4, "deepseek_v2",
     dict(data_parallel_shard_size=2, pipeline_parallel_size=2, expert_parallel_size=2)),
]


@pytest.fixture(scope="module")
def references(gloo_world, tmp_path_factory):
    return single_process_references(gloo_world, tmp_path_factory)


@pytest.mark.parametrize("name,world_size,model_type,train", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_family_layout_matches_single_process(name, world_size, model_type, train, gloo_world, references, tmp_path):
    check_layout(world_size, model_type, train, gloo_world, references, tmp_path)
