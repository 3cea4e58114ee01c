"""The memory a real training step allocates on top of what it starts with, read from the allocator.

On CPU, torch has no allocator statistics of its own; its profiler does: with profile_memory=True
every allocation and free of the CPU allocator is reported with the running total of the bytes
allocated since profiling began ("Total Allocated" of each [memory] event, kept by
c10's ProfiledCPUMemoryReporter, which can size the frees of blocks it saw allocated). Profiling
two steps and reading the second (its maximum running total minus the total at its start) gives
exactly the peak the step adds above the bytes held when it began (parameters, optimizer state): its activations,
gradients, gathered parameters, communication buffers and temporaries. On CUDA the same quantity
is torch.cuda.max_memory_allocated() - memory_allocated() at the step's start.

``profiled_peak(step)`` is that reading for any callable (bench/bench_fused_ce.py measures the
loss alone with it). ``step_transient_peak(config)`` runs where the process group is set up (a rank of
xorl/testing/multirank.py's GlooWorld, or one process): a Trainer, one step (AdamW's state is
created), then the measured step. Module-level so it travels to the ranks by pickle.
"""

from __future__ import annotations

import json
import os
import tempfile


def profiled_peak(step) -> int:
    """Profile two steps and read the second: blocks allocated before profiling began (whose frees the
    profiler cannot size) are freed in the first, so the second's running total is exact."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("xorl_measured_step"):
            step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    span = next(e for e in events if e.get("name") == "xorl_measured_step" and e.get("ph") == "X")
    begin, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
                    key=lambda e: e["ts"])
    before = [e["args"]["Total Allocated"] for e in memory if e["ts"] < begin]
    inside = [e["args"]["Total Allocated"] for e in memory if begin <= e["ts"] <= end]
    return max(inside, default=0) - (before[-1] if before else 0)


def step_transient_peak(config) -> int:
    """Peak bytes allocated during one training step above those held at its start (see the docstring)."""
    import torch

    from xorl.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()  # AdamW's state now exists: the baseline of every later step
    if torch.cuda.is_available() and trainer.device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        peak = profiled_peak(trainer.train_step)
    return peak


def selective_cache_bytes(config) -> list[int]:
    """Bytes each checkpointed block's selective-checkpoint cache keeps in one training step
    (train.activation_checkpointing: selective): the outputs its policy saves, read where torch's
    SAC asks the policy (the op's output is on the context), first forward only. One Trainer step;
    module-level so it travels to a GlooWorld's ranks by pickle."""
    import torch
    import torch.utils.checkpoint as torch_checkpoint
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy

    from xorl.trainer import Trainer

    create, blocks = torch_checkpoint.create_selective_checkpoint_contexts, []

    def recording(policy, *args, **kwargs):
        kept = []
        blocks.append(kept)

        def recorded_policy(ctx, op, *op_args, **op_kwargs):
            decision = policy(ctx, op, *op_args, **op_kwargs)
            saves = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
            if saves and not ctx.is_recompute:
                kept.extend(t.numel() * t.element_size() for t in tree_leaves(ctx.op_output)
                            if isinstance(t, torch.Tensor))
            return decision
        return create(recorded_policy, *args, **kwargs)

    # Patched before the model is built: the matmuls policy binds the function when checkpointing is applied.
    torch_checkpoint.create_selective_checkpoint_contexts = recording
    try:
        Trainer(config).train_step()
    finally:
        torch_checkpoint.create_selective_checkpoint_contexts = create
    return [sum(kept) for kept in blocks]
