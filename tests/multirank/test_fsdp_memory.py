"""Exact per-rank accounting of what FSDP2 holds unsharded (tests/support/fsdp_memory.py), for the two
FSDP sharding levels and under pipeline parallelism."""

import pytest

from tests.support.parity_runs import tiny_config

PP_FSDP = [
    ("1F1B", dict(pipeline_parallel_schedule="1F1B")),
    ("Interleaved1F1B", dict(pipeline_parallel_schedule="Interleaved1F1B", virtual_pipeline_stages=2)),
]


@pytest.mark.parametrize("name,train", PP_FSDP, ids=[layout[0] for layout in PP_FSDP])
def test_pipeline_with_fsdp_holds_one_block_unsharded(name, train, gloo_world, tmp_path):
    """PP 2 × FSDP 2: each stage holds its parameters and gradients sharded, plus the blocks in flight.

    torch's PipelineStage alone keeps every block of the stage unsharded, with unsharded fp32
    gradients, for the whole step (5 of 5 groups here); xorl keeps FSDP's per-microbatch reshard
    and reduce-scatter (xorl/parallel/pipeline_parallel.py).
    """
    from tests.support.fsdp_memory import peak_held_in_step

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



GRAD_SYNC = [
    ("per_microbatch", "default"),
    ("per_step", "default"),
    ("per_step", "never"),
]


@pytest.mark.parametrize("grad_sync,reshard", GRAD_SYNC, ids=[f"{g}-{r}" for g, r in GRAD_SYNC])
def test_pipeline_grad_sync_reduces_per_microbatch_or_once_per_step(grad_sync, reshard, gloo_world, tmp_path):
    """PP 2 x FSDP 2, 1F1B, 4 microbatches a step on 4 layers: FSDP's reduce-scatters and all-gathers
    counted per parameter group (tests/support/fsdp_memory.py collectives_per_group). per_microbatch: every
    group reduce-scatters once per microbatch; per_step (torch's PipelineStage): once per step. With
    fsdp_reshard_after_forward: never as well, every group is gathered once per step (m + 1 times
    otherwise, the count xorl/planner/step_time.py prices)."""
    from tests.support.fsdp_memory import collectives_per_group

    steps, microbatches = 2, 4
    config = tiny_config(str(tmp_path), "llama", gradient_accumulation_steps=microbatches, max_steps=4,
                         data_parallel_shard_size=2, pipeline_parallel_size=2, pipeline_grad_sync=grad_sync,
                         fsdp_reshard_after_forward=reshard)
    for rank, got in enumerate(gloo_world(4).run(collectives_per_group, config, steps)):
        per_step = [n / steps for n in got["reduce"]]
        assert len(per_step) == 3, (rank, got)  # two decoder blocks and the stage's root group
        assert per_step == [microbatches if grad_sync == "per_microbatch" else 1] * 3, (rank, got)
        gathers = [n / steps for n in got["gather"]]
        if reshard == "never":
            assert gathers == [1] * 3, (rank, got)
        elif grad_sync == "per_microbatch":  # for the forward and again for the backward of every microbatch
            assert gathers == [2 * microbatches] * 3, (rank, got)
        else:  # for every forward, and once for the backward: a block stays gathered after its backward
            # until its next forward reshards it, then is gathered again by the cool-down's first backward
            assert gathers == [microbatches + 1] * 3, (rank, got)


@pytest.mark.parametrize("reshard", ["default", "never"])
def test_per_step_grad_sync_holds_the_stage_unsharded_as_the_planner_counts(reshard, gloo_world, tmp_path):
    """PP 2 x FSDP 2 (fp32), 8 layers, pipeline_grad_sync: per_step: FSDP2's buffers at their peak are
    every group of the stage gathered, with its unsharded fp32 gradient, and the planner's FSDP term
    (xorl/planner/memory.py: the stage's elements x (p_u + 4), beside the buffers held throughout)
    is those bytes exactly. The stage's elements by hand: a layer q 32x32, k and v 32x16, o 32x32,
    gate / up / down 32x64, two norms of 32: 9,280; the embedding (and the lm_head) 272 x 32."""
    from tests.support.fsdp_memory import peak_held_in_step
    from xorl.distributed.parallel_config import ParallelConfig
    from xorl.models.spec import ModelSpec
    from xorl.planner.activations import inflight_microbatches
    from xorl.planner.memory import WORKSPACE_BYTES, _comm_buffers, estimate
    from xorl.planner.shapes import model_shapes

    config = tiny_config(str(tmp_path), "llama", gradient_accumulation_steps=4, max_steps=3,
                         data_parallel_shard_size=2, pipeline_parallel_size=2, pipeline_grad_sync="per_step",
                         fsdp_reshard_after_forward=reshard)
    config.model.num_hidden_layers = 8
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    stages = [4 * layer + 272 * 32, 4 * layer + 32 + 272 * 32]  # embedding | final norm and lm_head
    p, shapes = ParallelConfig.from_config(config, 4), model_shapes(config.model)
    spec, t = ModelSpec.from_config(config.model), config.data.seq_len
    for rank, got in enumerate(gloo_world(4).run(peak_held_in_step, config)):
        pp_rank = rank // 2  # the mesh's outermost dimension
        peak, stage = got["peak"], stages[pp_rank]
        assert peak["blocks_unsharded"] == peak["blocks_with_unsharded_grads"] == got["groups"] == 5, (rank, got)
        assert peak["unsharded_params"] == got["all_groups"] == 4 * stage, (rank, got, stage)
        assert peak["unsharded_grads"] == 4 * stage, (rank, got, stage)
        held = WORKSPACE_BYTES + _comm_buffers(spec, p, 4, t, inflight_microbatches("1F1B", 2, 4, 1, pp_rank))
        planned = estimate(config, p, shapes, pp_rank, "fp32-master").other
        assert planned - held == peak["unsharded_params"] + peak["unsharded_grads"], (rank, planned - held, peak)


@pytest.mark.parametrize("setting", ["always", "never"])
def test_reshard_after_forward_frees_the_blocks_between_forward_and_backward(setting, gloo_world, tmp_path):
    """FSDP 2: right after the forward, "always" (ZeRO-3) holds no decoder block gathered (at most the
    root group: embedding, norm, head, which older FSDP2 keeps for the backward); "never" (ZeRO-2)
    holds every group gathered until the backward."""
    from tests.support.fsdp_memory import held_after_forward

    config = tiny_config(str(tmp_path), "llama", gradient_accumulation_steps=2, max_steps=3,
                         data_parallel_shard_size=2, fsdp_reshard_after_forward=setting)
    for rank, got in enumerate(gloo_world(2).run(held_after_forward, config)):
        held = got["held"]
        if setting == "always":
            assert held["unsharded_params"] in (0, got["root_group"]), (rank, got)
            assert held["blocks_unsharded"] <= 1, (rank, got)
        else:
            assert held["unsharded_params"] == got["all_groups"], (rank, got)
            assert held["blocks_unsharded"] == got["groups"], (rank, got)
