"""Preemption: on SIGTERM / SIGUSR1 (``train.preempt_signals``) finish the step, save, exit 75.

A scheduler that preempts a job sends a signal and, after a grace period, SIGKILL. Before this,
the default action of SIGTERM killed the ranks and every step since the last checkpoint was lost.

What happens now:
- The first signal only sets a flag (and says so on that rank), from a watcher thread that reads
  it even while the main thread waits inside a collective. The handler puts the default action
  back, so a second signal ends the process at once (killed by the signal: exit 128 + N).
- A SIGTERM that is torchrun stopping the job because another rank failed (that rank counted
  itself in the store, xorl/run/fatal.py) is not a preemption: the rank exits at once, quietly.
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

        from xorl.run.fatal import write_error_file

        if int(os.environ.get("RANK", "0")) == 0:
            print(f"xorl: {self}", flush=True)
        write_error_file(f"preempted: checkpoint saved, exit code {PREEMPTED_EXIT} (see the xorl line above)")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT)


class PreemptionGuard:
    """Signal handlers for one ``train()`` call, and the per-step agreement on stopping.

    Why a watcher thread: Python runs a signal handler only when the main thread is back in the
    interpreter, and a rank waiting in a collective for a stalled peer is not (it is inside gloo or
    a device sync). The C-level handler still writes the signal's number to a wakeup pipe
    (``signal.set_wakeup_fd``); the watcher thread reads it and acts at once: it starts the grace
    timer, and tells a preemption from torchrun stopping the job because another rank failed (that
    rank counted itself in the store, xorl/run/fatal.py): then this rank leaves at once and quietly
    instead of waiting out torchrun's ``--shutdown-timeout`` to be SIGKILLed. The Python-level
    handler only puts the default action back, so a second signal ends the process at once.
    """

    def __init__(self, signal_names: list[str], grace_s: float, device: torch.device):
        self.signals = [getattr(signal, name) for name in signal_names]
        self.grace_s = grace_s
        self.received: int | None = None  # the first signal number this rank got
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._flag = torch.zeros(1, dtype=torch.int32, device=device) if self.signals else None
        self._lock = threading.Lock()
        self._seen = 0  # signals the watcher read
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup = -1
        if threading.current_thread() is not threading.main_thread():
            self.signals = []  # Python delivers signals to the main thread only
            self._flag = None
        if self.signals:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._pipe = (read_fd, write_fd)
            threading.Thread(target=self._watch, args=(read_fd,), name="xorl-preemption", daemon=True).start()
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        """Main thread (when it gets to it): a second signal gets the default action, i.e. exits at once."""
        for other in self.signals:
            signal.signal(other, signal.SIG_DFL)

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                data = b""
            if not data:  # close(): the write end is gone
                os.close(read_fd)
                return
            for signum in data:
                if signum not in self.signals:
                    continue  # another handler's signal (SIGINT, ...)
                self._seen += 1
                if self._seen == 1:
                    self._begin(signum)
                else:  # the main thread has not run the handler yet (blocked): exit at once here
                    os._exit(128 + signum)

    def _begin(self, signum: int) -> None:
        """The first signal, on the watcher thread."""
        name = signal.Signals(signum).name
        with self._lock:
            if self.received is not None or self._pipe is None:
                return
            self._timer = threading.Timer(self.grace_s, self._out_of_time, args=(name,))
            self._timer.daemon = True
            self._timer.start()
        from xorl.run.fatal import another_rank_failed, exit_quietly_after_another_rank

        if another_rank_failed():  # torchrun stopping the job after a rank's fatal error: not a preemption
            exit_quietly_after_another_rank()
        self.received = signum
        rank = os.environ.get("RANK", "0")
        os.write(2, (f"xorl (rank {rank}): {name} received: finishing the current step, then saving a checkpoint "
                     f"and exiting with code {PREEMPTED_EXIT} (within train.preempt_grace_s={self.grace_s:g} s); "
                     f"send {name} again to exit at once\n").encode())

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
        """Put the earlier handlers back, stop the grace timer and the watcher (``train`` returns or raises)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            pipe, self._pipe = self._pipe, None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        if pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(pipe[1])  # the watcher reads end-of-file and closes the read end
