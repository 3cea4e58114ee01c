"""Spawn an N-rank gloo world once and run many checks inside it.

Why a persistent world: starting a process and importing torch costs seconds per rank on a
2-core CI machine, so a test module starts one ``GlooWorld`` and sends it many check functions.
Why ranks are forked from a server that has already imported torch (multiprocessing's
"forkserver" with a preload list): a new rank then costs a fork, not an import of torch,
torch.distributed and its checkpoint / pipelining modules (~4 CPU-seconds per rank).

Every call carries an id. A rank answers with the id of the call it ran; the parent drops answers
with any other id, and whatever stops a call early (the harness's own timeout, an error on one
rank, pytest-timeout's exception, Ctrl-C) tears the world down before it propagates, because its
ranks may still be running that call. So a late answer is never taken for the next call's; the
next call starts a fresh world.

Why a timeout on every call: a collective that one rank never joins hangs the others forever;
here the call fails with a message naming the call and the ranks that did not answer.
``set_deadline(t)`` (a ``time.monotonic()`` instant; tests/conftest.py sets it from pytest-timeout's
timer for each test) makes every call of every world end by then at the latest, so the harness,
not pytest, reports the call that hung.

Why each call destroys the process groups it created (group_cleanup.py): every gloo group holds
three threads while it lives, and a check that builds a ParallelState or a Trainer creates a
dozen groups; a reused rank piled up hundreds of threads over a suite. Only the default group
survives a call, so a check must not keep a group in a global for a later call: if one does, the
harness sees the threads left over, warns, and restarts that world.

Check functions must be importable (module level) because they travel to the ranks by pickle.
Each runs as ``fn(*args, **kwargs)`` on every rank with the default process group initialised;
use ``torch.distributed.get_rank()`` inside. Return values come back as a list indexed by rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

DEFAULT_TIMEOUT_S = 180.0
START_TIMEOUT_S = 240.0
# Imported once by the fork server, so each rank starts with them loaded. Only torch: a module
# that reads the environment at import (triton reads TRITON_INTERPRET) must be imported by the
# rank itself, after GlooWorld(env=...) has been applied.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
)
_START_ID = 0  # the id of the start-up handshake; calls count from 1
_deadline: float | None = None


def set_deadline(deadline: float | None) -> float | None:
    """No world call runs past this ``time.monotonic()`` instant (None: only each call's timeout).

    Returns the previous deadline, so a caller can restore it.
    """
    global _deadline
    previous, _deadline = _deadline, deadline
    return previous


class RankError(AssertionError):
    """A check raised on one or more ranks; the message carries each failing rank's traceback."""


def _worker(rank: int, world_size: int, init_file: str, conn, pg_timeout_s: float, env: dict) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    import torch
    import torch.distributed as dist

    from xorl.testing import group_cleanup

    # One intra-op thread per rank: N ranks share 2 cores on CI.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    dist.barrier()
    # The count of gloo threads with only the default group alive: a call that ends above it kept
    # a group. Settled, because a new thread names itself only once it has been scheduled.
    baseline = group_cleanup.settle_gloo_threads()
    group_cleanup.freeze_survivors()
    conn.send((_START_ID, "ok", None, 0))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        call_id, fn, args, kwargs = msg
        keep = group_cleanup.live_groups()
        baseline = max(baseline, group_cleanup.gloo_thread_count())
        try:
            status, payload = "ok", fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - the parent reports every failure
            status, payload = "err", traceback.format_exc()
        group_cleanup.destroy_groups_not_in(keep)
        kept = group_cleanup.gloo_thread_count() - baseline
        try:
            conn.send((call_id, status, payload, kept))
        except Exception:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send((call_id, "err", traceback.format_exc(), kept))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


def _context():
    ctx = mp.get_context("forkserver")
    # Takes effect when the (process-wide) fork server starts, i.e. before the first world.
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class GlooWorld:
    """A pool of ``world_size`` processes, each a rank of one gloo process group.

    >>> with GlooWorld(4) as world:
    ...     results = world.run(my_check, 0.5)   # my_check runs on all 4 ranks

    ``env`` is applied in each rank before it imports anything beyond ``PRELOAD``.
    """

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, env: dict | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.starts = 0  # how many times the ranks were started (restarts included)
        self._procs: list = []
        self._conns: list = []
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._last_id = _START_ID

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> GlooWorld:
        if self._procs:
            return self
        ctx = _context()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="xorl-gloo-")
        init_file = os.path.join(self._tmpdir.name, "store")
        self.starts += 1
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker,
                    # The process group's own timeout is the harness's, so a rank stuck in a
                    # collective also gives up by itself.
                    args=(rank, self.world_size, init_file, child, self.timeout_s, self.env),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._collect(_START_ID, f"start-up of {self.world_size} ranks", self._time_left(START_TIMEOUT_S))
        except BaseException:
            self._kill()
            raise
        return self

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> GlooWorld:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running checks --------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        Raises RankError if any rank raised, TimeoutError if any rank did not answer within
        ``timeout_s`` (default: the world's) or by the deadline (``set_deadline``). Either way,
        and on anything else that interrupts the wait, the world is torn down (ranks may be stuck
        in a collective or still running this call) and restarted on the next call.
        """
        self.start()
        self._last_id += 1
        call_id = self._last_id
        name = f"call #{call_id} {getattr(fn, '__qualname__', repr(fn))}"
        try:
            for conn in self._conns:
                conn.send((call_id, fn, args, kwargs))
            return self._collect(call_id, name, self._time_left(timeout_s or self.timeout_s))
        except BaseException:
            self._kill()
            raise

    @staticmethod
    def _time_left(timeout_s: float) -> float:
        if _deadline is None:
            return timeout_s
        return max(0.0, min(timeout_s, _deadline - time.monotonic()))

    def _collect(self, call_id: int, name: str, timeout_s: float) -> list[Any]:
        start = time.monotonic()
        deadline = start + timeout_s
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        kept: dict[int, int] = {}  # gloo threads a rank still had after the call's clean-up
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Sleep until a pending rank answers or exits (its sentinel becomes ready).
            wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], min(left, 1.0))
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll():
                    try:
                        answer_id, status, payload, kept[rank] = conn.recv()
                    except EOFError:
                        answer_id, status, payload = call_id, "err", f"rank {rank} exited (code {proc.exitcode})"
                    if answer_id != call_id:
                        continue  # a late answer to an earlier call: never this call's result
                    pending.discard(rank)
                    if status == "err":
                        errors[rank] = payload
                        # Other ranks may now wait forever on a collective: give them a short
                        # grace period to report their own errors, not the full timeout.
                        deadline = min(deadline, time.monotonic() + 5)
                    else:
                        results[rank] = payload
                elif not proc.is_alive():
                    pending.discard(rank)
                    errors[rank] = f"rank {rank} died with exit code {proc.exitcode}"
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            hung = f" (ranks {sorted(pending)} did not answer)" if pending else ""
            raise RankError(f"{name} failed on ranks {sorted(errors)}{hung}:\n{detail}")
        if pending:
            cut = _deadline is not None and time.monotonic() >= _deadline
            limit = "by the test's deadline (set before pytest-timeout's)" if cut else f"within {timeout_s:.0f}s"
            raise TimeoutError(
                f"{name}: ranks {sorted(pending)} of {self.world_size} did not finish {limit}, "
                f"{time.monotonic() - start:.0f}s after it began (a collective that some rank never joined?)"
            )
        leaked = {r: n for r, n in kept.items() if n > 0}
        if leaked:
            # Something still holds a group that the clean-up destroyed: a later call on this rank
            # could be handed it. A fresh world is cheaper than finding out.
            warnings.warn(f"{name} kept process groups alive (gloo threads left per rank: {leaked}), "
                          "e.g. in a module-level cache; its world is restarted", RuntimeWarning, stacklevel=3)
            self.close()
        return results


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args, timeout_s: float = DEFAULT_TIMEOUT_S,
                 **kwargs) -> list[Any]:
    """One-shot helper: start a world, run one check, tear it down."""
    with GlooWorld(world_size, timeout_s=timeout_s) as world:
        return world.run(fn, *args, **kwargs)
