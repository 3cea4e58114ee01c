"""Preemption: on SIGTERM / SIGUSR1 (``train.preempt_signals``) finish the step, save, exit 75.

A scheduler that preempts a job sends a signal and, after a grace period, SIGKILL. Before this,
the default action of SIGTERM killed the ranks and every step since the last checkpoint was lost.

What happens now:
- The first signal only sets a flag (and says so on that rank). The handler also puts the default
  action back, so a second signal ends the process at once (killed by the signal: exit 128 + N).
- Every step ends with ``should_stop()``: a MAX all-reduce of one int32 over all ranks, on the
  compute device. A signal reaches the ranks at different times (one node first, or only the
  launcher's children); the reduction makes every rank stop after the same step. Cost: one
  4-byte all-reduce and one 4-byte device-to-host read per step, issued after the step's own host
  read (so the device has no queued work left to wait for): the collective's latency, tens of
  microseconds within a node, well under 0.1% of a step that takes seconds. With
  ``preempt_signals: []`` there is no handler and no collective.
- After the step the trainer saves a blocking (atomic) checkpoint, rank 0 says which, and every
  rank raises ``Preempted``; the command line exits with ``PREEMPTED_EXIT`` (75, EX_TEMPFAIL:
  "try again", so a wrapper can requeue and resume with ``--train.resume=true``).
- ``train.preempt_grace_s`` (default 120 s) bounds the time from the signal to the exit: if the
  step and the save are not done by then, the rank exits 75 at once, leaving the previous
  checkpoint as ``latest`` (saves are atomic). Set it below the scheduler's own grace.

Under torchrun: a signal sent to the workers (SLURM signals every process of the job step) is
handled as above, and torchrun's summary shows exit code 75 for each rank. A SIGTERM sent to the
torchrun process itself makes torchrun forward SIGTERM to the workers and SIGKILL them
``--shutdown-timeout`` seconds later (default 30): give torchrun the same grace, or signal the
workers (SIGUSR1, which torchrun does not catch, is a scheduler's usual choice).
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75


class Preempted(Exception):
    """Raised on every rank once the preemption checkpoint is saved; the CLI exits with 75."""

    exit_code = PREEMPTED_EXIT

    def exit(self) -> None:
        """Rank 0 prints the message; every rank leaves with exit code 75."""
        import sys

        from xorl.fatal import write_error_file

        if int(os.environ.get("RANK", "0")) == 0:
            print(f"xorl: {self}", flush=True)
        write_error_file(f"preempted: checkpoint saved, exit code {PREEMPTED_EXIT} (see the xorl line above)")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT)


class PreemptionGuard:
    """Signal handlers for one ``train()`` call, and the per-step agreement on stopping."""

    def __init__(self, signal_names: list[str], grace_s: float, device: torch.device):
        self.signals = [getattr(signal, name) for name in signal_names]
        self.grace_s = grace_s
        self.received: int | None = None  # the first signal number this rank got
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._flag = torch.zeros(1, dtype=torch.int32, device=device) if self.signals else None
        if threading.current_thread() is not threading.main_thread():
            self.signals = []  # Python delivers signals to the main thread only
            self._flag = None
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        for other in self.signals:  # a second signal: the default action, i.e. exit at once
            signal.signal(other, signal.SIG_DFL)
        name = signal.Signals(signum).name
        rank = os.environ.get("RANK", "0")
        # os.write: print() from a handler can re-enter a buffered stream the main thread is using.
        os.write(2, (f"xorl (rank {rank}): {name} received: finishing the current step, then saving a checkpoint "
                     f"and exiting with code {PREEMPTED_EXIT} (within train.preempt_grace_s={self.grace_s:g} s); "
                     f"send {name} again to exit at once\n").encode())
        self._timer = threading.Timer(self.grace_s, self._out_of_time, args=(name,))
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self, name: str) -> None:
        os.write(2, (f"xorl: {name}: the step and its checkpoint did not finish within train.preempt_grace_s="
                     f"{self.grace_s:g} s; exiting now (the checkpoint named by 'latest' is the previous one)\n"
                     ).encode())
        os._exit(PREEMPTED_EXIT)

    def should_stop(self) -> int:
        """Collective, after every step: the signal number if any rank got one (0: go on)."""
        if self._flag is None:
            return 0
        self._flag.fill_(self.received or 0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return int(self._flag.item())  # after the step's own host read: nothing queued to wait for

    def stopped(self, signum: int, step: int, path: str) -> Preempted:
        """The checkpoint is saved: from here every rank only exits (75), so further signals (torchrun
        stopping the workers once the first one exits) are ignored rather than turn 75 into -15."""
        for signum_ in self.signals:
            signal.signal(signum_, signal.SIG_IGN)
        self._previous = {}
        name = signal.Signals(signum).name
        return Preempted(f"preempted ({name}): saved checkpoint {path} at step {step}; exiting with code "
                         f"{PREEMPTED_EXIT}. Continue with --train.resume=true")

    def close(self) -> None:
        """Put the earlier handlers back and stop the grace timer (``train`` returns or raises)."""
        if self._timer is not None:
            self._timer.cancel()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
