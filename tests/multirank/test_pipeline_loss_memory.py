"""Under pipeline parallelism the last stage computes the loss in the model's forward (fused with
lm_head by default, model.fused_loss): a training step never holds the [tokens, vocab] logits.

Read from the CPU allocator (xorl/planner/measure.py) on two gloo ranks, PP 2 with 1F1B: a model
whose logits dwarf everything else (vocab 8192, hidden 64, 1024 tokens a microbatch: 32 MiB of fp32
logits against 2 MiB of lm_head). With the fused loss the step's peak stays below one fp32 copy of
the logits, and the planner's step peak (xorl/planner/memory.py) matches it to within 10 %; with
model.fused_loss false the same step holds the logits and their fp32 softmax and gradient (the
instrument sees them). Measured: fused 18.6 MiB (the planner's step peak 14.4 MiB, plus the fp32
[chunk, vocab] temporary of the CPU reference that the Triton kernels do not allocate: 4 MiB),
unfused 104.3 MiB (the planner 104.5 MiB, +0.2 %; it was 136.5, +31 %, while its loss term charged
the logits a pipeline stage frees after its forward: now 12 bytes per logit there).
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.paths import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
from plan_calibrate import predicted_transient  # noqa: E402

TOKENS, VOCAB = 2 * 512, 8192
LOGITS_FP32 = TOKENS * VOCAB * 4


def pp_config(output_dir: str, fused_loss: bool):
    from xorl.config import Config

    return Config.from_dict({
        "model": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "max_position_embeddings": 4096, "fused_loss": fused_loss},
        "data": {"seq_len": 512, "micro_batch_size": 2},
        "train": {"data_parallel_mode": "fsdp2", "data_parallel_shard_size": 1, "pipeline_parallel_size": 2,
                  "gradient_accumulation_steps": 2, "max_steps": 3, "warmup_steps": 1, "save_steps": 0,
                  "output_dir": output_dir},
    })


@pytest.mark.parametrize("fused_loss", [True, False], ids=["fused", "unfused"])
def test_pipelined_step_peak_holds_no_logits_with_the_fused_loss(fused_loss, gloo_world, tmp_path):
    from xorl.planner.measure import step_transient_peak

    config = pp_config(str(tmp_path / "run"), fused_loss)
    measured = max(gloo_world(2).run(step_transient_peak, config))
    predicted = predicted_transient(config)
    print(f"fused_loss={fused_loss}: measured {measured / 2**20:.1f} MiB, planner {predicted / 2**20:.1f} MiB")
    if fused_loss:
        assert 0 < measured < LOGITS_FP32, measured
        # The planner's PP model with the fused loss term, plus the CPU reference's fp32 chunk temporary.
        from xorl_kernels.fused_linear_ce.op import default_chunk_size

        cpu_only = default_chunk_size(TOKENS, VOCAB, 64) * VOCAB * 4
        assert abs((predicted + cpu_only) / measured - 1) <= 0.10, (predicted, cpu_only, measured)
    else:
        assert measured > 2 * LOGITS_FP32, measured
        # the saved log-softmax and the two gradient temporaries of F.cross_entropy's backward; a
        # pipeline stage holds no logits (its output is the loss sum)
        assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)
