"""No host sync in the training step: between the first forward and the optimizer step, no layout
reads a device value on the host, except the split sizes of expert parallelism (one per MoE layer
per microbatch). Counted on CPU through tests/support/host_reads.py; scripts/gpu_check.sh checks the same
on a GPU with torch.cuda.set_sync_debug_mode("error")."""

import pytest

from tests.support.host_reads import host_reads_in_step
from tests.support.parity_runs import tiny_config

LAYOUTS = [
    ("fsdp", "llama", dict(data_parallel_shard_size=4)),
    ("fsdp+tp+sp", "llama", dict(data_parallel_shard_size=2, tensor_parallel_size=2, sequence_parallel=True)),
    ("tp+ring", "llama", dict(data_parallel_shard_size=1, tensor_parallel_size=2, ringattn_parallel_size=2)),
    ("ring x ulysses", "llama", dict(data_parallel_shard_size=1, ringattn_parallel_size=2, ulysses_parallel_size=2)),
    ("pp+fsdp", "llama", dict(data_parallel_shard_size=2, pipeline_parallel_size=2)),
    ("moe ep2 over fsdp4", "qwen3_moe", dict(data_parallel_shard_size=4, expert_parallel_size=2)),
]
MICROBATCHES = 2


@pytest.mark.parametrize("name,model_type,train", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_no_host_reads_between_first_forward_and_optimizer_step(name, model_type, train, gloo_world, tmp_path):
    config = tiny_config(str(tmp_path), model_type, gradient_accumulation_steps=MICROBATCHES, max_steps=3, **train)
    per_rank = gloo_world(4).run(host_reads_in_step, config)
    moe_layers = config.model.num_hidden_layers if model_type == "qwen3_moe" else 0
    for rank, (others, ep_reads) in enumerate(per_rank):
        assert others == {}, f"rank {rank} reads device values on the host in the step: {others}"
        assert ep_reads == moe_layers * MICROBATCHES, (rank, ep_reads)

