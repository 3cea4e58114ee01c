"""No host sync in the training step: between the first forward and the optimizer step, no layout
reads a device value on the host, except the split sizes of expert parallelism (one per MoE layer
per microbatch). Counted on CPU through tests/host_reads.py; scripts/gpu_check.sh checks the same
on a GPU with torch.cuda.set_sync_debug_mode("error")."""

import pytest

from tests.host_reads import host_reads_in_step
from tests.parity_runs import tiny_config

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


PP_FSDP = [
    ("1F1B", dict(pipeline_parallel_schedule="1F1B")),
    ("Interleaved1F1B", dict(pipeline_parallel_schedule="Interleaved1F1B", virtual_pipeline_stages=2)),
]


@pytest.mark.parametrize("name,train", PP_FSDP, ids=[layout[0] for layout in PP_FSDP])
def test_pipeline_with_fsdp_holds_one_block_unsharded(name, train, gloo_world, tmp_path):
    """PP 2 × FSDP 2: each stage holds its parameters and gradients sharded, plus the blocks in flight.

    torch's PipelineStage alone keeps every block of the stage unsharded, with unsharded fp32
    gradients, for the whole step (5 of 5 groups here); xorl keeps FSDP's per-microbatch reshard
    and reduce-scatter (xorl/pipeline.py).
    """
    from tests.fsdp_memory import peak_held_in_step

    config = tiny_config(str(tmp_path), "llama", gradient_accumulation_steps=4, max_steps=3,
                         data_parallel_shard_size=2, pipeline_parallel_size=2, **train)
    config.model.num_hidden_layers = 8  # several blocks per stage, so "all of them" differs from "one"
    for rank, got in enumerate(gloo_world(4).run(peak_held_in_step, config)):
        peak = got["peak"]
        # The root group (embedding / norm / head) and one decoder block at a time.
        assert peak["blocks_unsharded"] <= 2, (rank, peak)
        assert peak["unsharded_params"] <= 2 * got["largest_group"], (rank, peak, got)
        # At most one block's gradient before its reduce-scatter; the rest is already sharded.
        assert peak["blocks_with_unsharded_grads"] <= 1, (rank, peak)
        assert peak["unsharded_grads"] <= got["largest_group"], (rank, peak, got)
        assert peak["sharded_grads"] == got["sharded_params"], (rank, peak, got)
