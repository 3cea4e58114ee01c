"""xorl-plan's activation model held to the allocator: the peak a real training step adds on CPU.

Two gloo ranks train a small Llama and a small MoE (scripts/plan_calibrate.py's CPU_* configs, fp32,
1024 tokens a microbatch) one step, then the measured step's peak above its start is read from the
CPU allocator's running total (xorl/planner/measure.py, torch's profiler with profile_memory) and
compared with the planner's modelled peak moment (Memory.step_peak less the GPU kernel workspace).
The whole grid (2 models x FSDP 2 / TP 2 + SP / ring 2 x none / selective / full) runs with
`python scripts/plan_calibrate.py --cpu-activations`; this file checks a cut of it in a minute.

Measured at this commit (the full grid, bench/results/plan-cpu-activations.json): 13 of the 17 runs
xorl-train accepts within 10 %; not yet: the MoE under TP 2 + SP (+12 % none, +16 % full) and
selective under ring 2 (+11 % Llama, +10 % MoE). Those are left out of this cut; the measured peaks
also move by a few MB with what the ranks ran before (lazily built process-wide state), too close to
a strict xfail's edge. The grid prints them.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from plan_calibrate import cpu_config, predicted_transient  # noqa: E402

TOLERANCE = 0.10
# Since the fused RMSNorm / RoPE / SwiGLU custom ops landed (xorl_kernels/rmsnorm, rope, activation),
# a step without checkpointing keeps fewer tensors than xorl/planner/memory.py assumes: measured at
# that merge the planner over-predicts by 21-26 % on these three runs. Held as strict xfails until
# the activation model follows the fused ops (issue 24).
_FUSED_OPS = pytest.mark.xfail(strict=True, reason="planner's activation model predates the fused norm/RoPE/"
                                                   "SwiGLU ops: over-predicts `none` by 21-26 %")
RUNS = [
    pytest.param("llama", "fsdp2", "none", id="llama-fsdp2-none", marks=_FUSED_OPS),
    pytest.param("llama", "fsdp2", "selective", id="llama-fsdp2-selective"),
    pytest.param("llama", "tp2+sp", "selective", id="llama-tp2sp-selective"),
    pytest.param("llama", "ring2", "none", id="llama-ring2-none", marks=_FUSED_OPS),
    pytest.param("moe", "fsdp2", "none", id="moe-fsdp2-none", marks=_FUSED_OPS),
]


@pytest.mark.parametrize("model, layout, mode", RUNS)
def test_predicted_step_peak_matches_the_allocator(model, layout, mode, gloo_world, tmp_path):
    from xorl.planner.measure import step_transient_peak

    config = cpu_config(model, layout, mode, str(tmp_path / "run"))
    measured = max(gloo_world(2).run(step_transient_peak, config))
    predicted = predicted_transient(config)
    assert measured > 0
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)


def test_the_profiler_peak_is_exact():
    # The measuring instrument itself, on known allocations. Each step frees the 4 MB the previous one
    # kept, allocates 4 MB to keep and 8 MB it frees: 12 MB live at the peak, 4 MB at the start,
    # so the step adds 8 MB; a block allocated before profiling (whose free the profiler cannot
    # size) is freed in the first, unread step.
    import torch

    from xorl.planner.measure import profiled_peak

    held = []

    def step():
        held.clear()
        a = torch.empty(1_000_000, dtype=torch.float32)  # 4 MB
        b = torch.empty(2_000_000, dtype=torch.float32)  # 8 MB
        del b
        held.append(a)

    held.append(torch.empty(3_000_000, dtype=torch.float32))  # allocated before profiling: freed in step 1
    assert profiled_peak(step) == 8_000_000
