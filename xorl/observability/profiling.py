"""Profiling on demand: a torch.profiler trace of chosen steps, and a CUDA memory snapshot.

- ``train.profile_steps: [start, end]`` (1-based steps, as on the console): every rank records steps
  start..end with torch.profiler (CPU, and CUDA kernels on a GPU; each step a ``ProfilerStep#N`` range,
  N the 1-based step, the name torch's own step ranges and trace tools use)
  and writes ``output_dir/profile/rank{r}/steps_{start}-{end}.json``, a Chrome trace (open it in
  Perfetto or chrome://tracing). A run resumed inside the range records from its first step; a run
  that stops inside it (preemption) writes what it recorded, named by the steps it holds.
- ``train.memory_snapshot_step: N``: every rank records the CUDA caching allocator's history from the
  start of training and writes ``output_dir/memory_snapshot/rank{r}_step{N}.pickle`` after step N
  (drag it onto https://pytorch.org/memory_viz). GPU-only: a CPU run is refused before start-up
  (``memory_snapshot_problems``), not silently left without its snapshot.

The trainer calls ``before_step`` / ``after_step`` around each step and ``close`` at the end.
"""

from __future__ import annotations

import os

import torch

from xorl.run.folder import MEMORY_SNAPSHOT_DIR, PROFILE_DIR

SNAPSHOT_MAX_ENTRIES = 100_000  # allocator events kept (torch's own example uses 100k)


def memory_snapshot_problems(train) -> list[str]:
    if train.memory_snapshot_step is None or torch.cuda.is_available():
        return []
    return [f"train.memory_snapshot_step={train.memory_snapshot_step}: a CUDA memory snapshot is GPU-only, and this "
            "machine has no GPU (torch.cuda.is_available() is false); remove memory_snapshot_step, or use "
            "train.profile_steps (torch.profiler, which runs on CPU too)"]


def trace_path(output_dir: str, rank: int, start: int, end: int) -> str:
    return os.path.join(output_dir, PROFILE_DIR, f"rank{rank}", f"steps_{start}-{end}.json")


def snapshot_path(output_dir: str, rank: int, step: int) -> str:
    return os.path.join(output_dir, MEMORY_SNAPSHOT_DIR, f"rank{rank}_step{step}.pickle")


class StepProfiler:
    """What ``train.profile_steps`` and ``train.memory_snapshot_step`` ask for, on this rank."""

    def __init__(self, train, rank: int, device: torch.device, first_step: int):
        self.output_dir, self.rank, self.device = train.output_dir, rank, device
        self.window = tuple(train.profile_steps) if train.profile_steps else None
        self.snapshot_step = train.memory_snapshot_step if device.type == "cuda" else None
        self._profiler = None
        self._first = None  # the first step the running profiler recorded
        self._step_range = None  # the running step's ProfilerStep#N range
        self._recording_memory = False
        if self.snapshot_step is not None and first_step < self.snapshot_step:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
            self._recording_memory = True

    def before_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run."""
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()
            self._first = step
        # Without a profiler schedule torch marks no steps: this range does (ours are not its step count).
        self._step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self._step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self._profiler is not None:
            self._end_step_range()
            if step == self.window[1]:
                self._write_trace(step)
        if self._recording_memory and step == self.snapshot_step:
            path = snapshot_path(self.output_dir, self.rank, step)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.cuda.memory._dump_snapshot(path)
            self._stop_memory_history()

    def close(self, last_step: int) -> None:
        """End of training (or a stop inside the window): write what was recorded, stop recording."""
        if self._profiler is not None:
            self._write_trace(last_step)
        if self._recording_memory:
            self._stop_memory_history()

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _write_trace(self, last_step: int) -> None:
        self._end_step_range()  # a step that failed or was cut short
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        if last_step < self._first:  # stopped before the first profiled step finished: nothing to show
            return
        path = trace_path(self.output_dir, self.rank, self._first, last_step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profiler.export_chrome_trace(path)

    def _stop_memory_history(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording_memory = False
