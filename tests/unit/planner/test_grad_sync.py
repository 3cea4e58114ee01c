"""xorl-plan's pricing of train.pipeline_grad_sync (xorl/planner/step_time.py): per_step with
fsdp_reshard_after_forward: never gathers and reduce-scatters each stage once per step, exposed,
where per_microbatch does both every microbatch. The memory term is held to FSDP2's own buffers
in tests/multirank/test_fsdp_memory.py; its collective counts there too."""

from __future__ import annotations

from xorl.config import Config
from xorl.distributed.parallel_config import ParallelConfig
from xorl.planner.efficiency import load
from xorl.planner.shapes import model_shapes
from xorl.planner.step_time import Hardware, step_time

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8)
HW = Hardware()  # H100 SXM, 8 a node


def _time(m: int, **train) -> float:
    config = Config.from_dict({
        "model": LLAMA3_8B, "data": {"seq_len": 4096, "micro_batch_size": 1},
        "train": {"dtype": "bfloat16", "pipeline_parallel_size": 2, "data_parallel_shard_size": 4,
                  "gradient_accumulation_steps": m, "activation_checkpointing": "full", **train}})
    return step_time(config, ParallelConfig.from_config(config, 8), model_shapes(config.model), HW).total


def _once_per_step(**train) -> float:
    """The step's part that does not grow with the microbatches, less 1F1B's bubble (one microbatch's
    time at PP 2): the step is m x (one microbatch) + once-per-step + (P - 1) x (one microbatch)."""
    t8, t16 = _time(8, **train), _time(16, **train)
    microbatch = (t16 - t8) / 8
    return t8 - 8 * microbatch - microbatch


def test_per_step_prices_one_gather_and_one_reduce_scatter_of_the_stage():
    # The last stage (the loss's lm_head: the peak rank) by hand: 16 layers of q, o 4096 x 4096, k, v
    # 4096 x 1024, gate / up / down 4096 x 14336, two norms; the final norm and lm_head 128256 x 4096.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    stage = 16 * layer + 4096 + 128256 * 4096
    eff = load(HW.efficiency)
    # One ring all-gather (bf16, 2 bytes) and one fp32 reduce-scatter (4) over the 4 FSDP ranks of a node.
    ring = stage * (2 + 4) * 3 / 4 / (HW.nvlink_gbps * 1e9 * eff.nvlink_fraction) + 3 * eff.latency_nvlink_s
    never = dict(fsdp_reshard_after_forward="never")
    extra = _once_per_step(pipeline_grad_sync="per_step", **never) - _once_per_step(**never)
    assert abs(extra / ring - 1) < 1e-6, (extra, ring)
    # and per_microbatch's collectives leave the microbatch's time: per_step is faster here
    assert _time(8, pipeline_grad_sync="per_step", **never) < _time(8, **never)
