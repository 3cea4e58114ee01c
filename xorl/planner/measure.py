"""The memory a real training step allocates on top of what it starts with, read from the allocator.

On CPU, torch has no allocator statistics of its own; its profiler does: with profile_memory=True
every allocation and free of the CPU allocator is reported with the running total of the bytes
allocated since profiling began ("Total Allocated" of each [memory] event, kept by
c10's ProfiledCPUMemoryReporter, which can size the frees of blocks it saw allocated). Profiling
two steps and reading the second (its maximum running total minus the total at its start) gives
exactly the peak the step adds above the bytes held when it began (parameters, optimizer state): its activations,
gradients, gathered parameters, communication buffers and temporaries. On CUDA the same quantity
is torch.cuda.max_memory_allocated() - memory_allocated() at the step's start.

Every thread, not only the profiled one. The reporter keeps its running total only on threads
that carry the profiler's state (c10's memoryProfilingEnabled is thread-local), and gloo runs each
collective on a worker thread of its own, which holds the work (and so its input tensors) until
it has finished and returns to its queue. When the training thread has dropped its references
first, the tensor is freed on the worker: a free the running total never saw, so every later
reading of the step stood that much too high. Under TP 2 + SP each of those is a row layer's
[t, h] reduce-scatter input (xorl/nn/tp_comm.py reduce_scatter_sequence, 1 MiB in the CPU grid):
two ranks of llama TP 2 + SP full recompute read 25.4-28.5 MB for one step whose true peak is
24.3 MB, and the step "ended" 1-4 MiB above its start. c10's flag caffe2_report_cpu_memory_usage
makes the reporter keep its table and total on every thread (its events still come from the
profiled one only, each carrying the process-wide total); ``profiled_peak`` sets it while it
profiles (ctypes on libc10, the flag's exported symbol). With it the same run reads 24.32 MB on
both ranks, every time, and the step ends where it began; the other threads' net changes between
two events of the training thread are frees alone (gloo's workers allocate nothing on these
paths; what they allocated would be counted too, at the training thread's next event).
``steady=True`` checks that end: a step of a training loop returns to its start (gradients set to
None, AdamW's state made in the first step), so a running total that does not has missed frees.
Within 1 % of the step's peak, not to the byte: a small tensor's free may still land on a worker
just after the step's last event or just after its start (+-256 bytes, twice in 12 readings),
while one missed activation buffer is a whole [t, h] (MiB), and 1 % cannot move a verdict the
tests give at 10 %.

``profiled_peak(step)`` is that reading for any callable (bench/bench_fused_ce.py measures the
loss alone with it). ``step_transient_peak(config)`` runs where the process group is set up (a rank of
xorl/testing/multirank.py's GlooWorld, or one process): a Trainer, one step (AdamW's state is
created), then the measured step. Module-level so it travels to the ranks by pickle.
"""

from __future__ import annotations

import json
import os
import tempfile

STEADY_DRIFT = 0.01  # how far a steady step's end may read from its start, of its peak (module docstring)


class _EveryThread:
    """c10's caffe2_report_cpu_memory_usage set while profiling (see the module docstring)."""

    def __enter__(self):
        import ctypes
        import glob

        import torch

        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
        if not libs:
            raise RuntimeError("xorl.planner.measure: torch's libc10 was not found; the CPU allocator's "
                               "running total cannot be kept on every thread")
        self.flag = ctypes.c_bool.in_dll(ctypes.CDLL(libs[0]), "FLAGS_caffe2_report_cpu_memory_usage")
        self.before, self.flag.value = self.flag.value, True
        return self

    def __exit__(self, *exc):
        self.flag.value = self.before


def profiled_peak(step, steady: bool = False) -> int:
    """Profile two steps and read the second: blocks allocated before profiling began (whose frees the
    profiler cannot size) are freed in the first, so the second's running total is exact. ``steady``:
    the step ends holding what it began with (a training step), checked."""
    return profiled_step(step, steady)["peak"]


def profiled_step(step, steady: bool = False) -> dict[str, int]:
    """profiled_peak's reading, and the bytes held above the step's start where ``mark(name)`` was
    first called inside it (the running total at the last allocator event before the mark)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with _EveryThread(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    start = before[-1] if before else 0
    peak = max(inside, default=0) - start
    if steady and inside and abs(inside[-1] - start) > STEADY_DRIFT * peak:
        raise RuntimeError(f"xorl.planner.measure: the step ended {inside[-1] - start} bytes away from its "
                           "start; the allocator's running total missed frees or the step is not steady")
    readings = {"peak": peak}
    for e in sorted(events, key=lambda e: -e.get("ts", 0)):  # the first mark of each name wins
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith(_MARK) and begin <= e["ts"] <= end:
            readings[name[len(_MARK):]] = max([start] + [m["args"]["Total Allocated"] for m in memory
                                                         if begin <= m["ts"] <= e["ts"]][-1:]) - start
    return readings


_MARK = "xorl_mark:"


def mark(name: str) -> None:
    """A point of the profiled step whose held bytes profiled_step reads."""
    from torch.profiler import record_function

    with record_function(_MARK + name):
        pass


def step_transient_peak(config) -> int:
    """Peak bytes allocated during one training step above those held at its start (see the docstring)."""
    return step_readings(config)["peak"]


def step_readings(config) -> dict[str, int]:
    """One training step (the second of a Trainer) above its start: ``peak``, and ``after_forward``, what
    the step holds when its last decoder layer's forward has returned (every block's kept tensors; under
    full recompute the hook fires again in the backward's recompute: the first is read)."""
    import torch

    from xorl.parallel.data_parallel import decoder_layers
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()  # AdamW's state now exists: the baseline of every later step
    cuda = torch.cuda.is_available() and trainer.device.type == "cuda"
    after_forward: list[int] = []

    def forward_end(*_):
        if cuda and not after_forward:
            after_forward.append(torch.cuda.memory_allocated())
        elif not cuda:
            mark("after_forward")

    layers = [layer for part in trainer.parts for layer in decoder_layers(part)]
    if layers:  # a pipeline stage may hold none
        layers[-1].register_forward_hook(forward_end)
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step()
        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated() - start, "after_forward": after_forward[0] - start}
    return profiled_step(trainer.train_step, steady=True)


def selective_cache_bytes(config) -> list[int]:
    """Bytes each checkpointed block's selective-checkpoint cache keeps in one training step
    (train.activation_checkpointing: selective): the outputs its policy saves, read where torch's
    SAC asks the policy (the op's output is on the context), first forward only. One Trainer step;
    module-level so it travels to a GlooWorld's ranks by pickle."""
    import torch
    import torch.utils.checkpoint as torch_checkpoint
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy

    from xorl.trainer.trainer import Trainer

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
