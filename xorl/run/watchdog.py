"""Two guards for a job that would otherwise hang or linger silently.

``Heartbeat``: while a step (or a save) takes longer than ``interval_s``, rank 0 prints a line every
``interval_s``, so a stalled rank shows up in the log long before ``train.collective_timeout_s``
ends the job. Why a thread: the main thread is blocked inside the collective (which releases the
GIL), so only another thread can speak.

``exit_with_launcher``: a torchrun worker dies with the torchrun that started it (killed, its
node's job cancelled), instead of training on as an orphan. Linux: prctl(PR_SET_PDEATHSIG) asks
the kernel to send SIGKILL when the parent exits; elsewhere a thread polls the parent id. Only
under torchrun (TORCHELASTIC_RUN_ID set): a single `nohup xorl-train ...` must outlive its shell.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def heartbeat_interval(heartbeat_s: float, timeout_s: float) -> float:
    """The heartbeat's period: ``heartbeat_s``, or a third of ``collective_timeout_s`` when
    ``heartbeat_s`` would come only after the timeout ended the job (a 30 s timeout with the 60 s
    default printed no line at all); xorl/run/preflight.py says so at start-up."""
    if heartbeat_s > 0 and heartbeat_s >= timeout_s:
        return timeout_s / 3
    return heartbeat_s


class Heartbeat:
    """``with heartbeat.busy("step 12"): ...``: lines while the block runs longer than ``interval_s``."""

    def __init__(self, interval_s: float, timeout_s: float, enabled: bool = True, write=None):
        self.interval_s, self.timeout_s = heartbeat_interval(interval_s, timeout_s), timeout_s
        self._write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self._label: str | None = None
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if enabled and self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="xorl-heartbeat", daemon=True)
            self._thread.start()

    def busy(self, label: str) -> Heartbeat:
        with self._lock:
            self._label, self._since = label, time.monotonic()
        return self

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._label = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        reported = None  # (label, since) of the last line, to count lines per busy block
        next_at = 0.0
        while not self._stop.wait(min(1.0, self.interval_s / 4)):
            with self._lock:
                label, since = self._label, self._since
            if label is None:
                continue
            waited = time.monotonic() - since
            if reported != (label, since):
                reported, next_at = (label, since), self.interval_s
            if waited >= next_at:
                self._write(
                    f"xorl: {label} still running after {waited:.0f} s (waiting for another rank?); a stalled "
                    f"rank ends the job after train.collective_timeout_s={self.timeout_s:g} s"
                )
                next_at += self.interval_s


def exit_with_launcher() -> None:
    """Under torchrun, make this worker die when torchrun (its parent) exits."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="xorl-parent-watch", daemon=True).start()
