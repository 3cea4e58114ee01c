"""Spawn an N-rank gloo world once and run many checks inside it.

Why a persistent world: spawning a process and importing torch costs seconds per rank on a
2-core CI machine, so a test module starts one ``GlooWorld`` and sends it many check functions.
Why a timeout on every call: a collective that one rank never joins hangs the others forever;
here the call fails with a message naming the ranks that did not answer, the world is torn down,
and the next call starts a fresh one.

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
from collections.abc import Callable
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 180.0


class RankError(AssertionError):
    """A check raised on one or more ranks; the message carries each failing rank's traceback."""


def _worker(rank: int, world_size: int, init_file: str, conn, pg_timeout_s: float, env: dict) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    import torch
    import torch.distributed as dist

    # One intra-op thread per rank: N ranks share 2 cores on CI.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - the parent reports every failure
            conn.send(("err", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


class GlooWorld:
    """A pool of ``world_size`` processes, each a rank of one gloo process group.

    >>> with GlooWorld(4) as world:
    ...     results = world.run(my_check, 0.5)   # my_check runs on all 4 ranks
    """

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, env: dict | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._procs: list = []
        self._conns: list = []
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> GlooWorld:
        if self._procs:
            return self
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix="xorl-gloo-")
        init_file = os.path.join(self._tmpdir.name, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, init_file, child, self.timeout_s, self.env),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("process-group start-up", self.timeout_s + 60)
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

        Raises RankError if any rank raised, TimeoutError if any rank did not answer in time.
        Either way the world is torn down (ranks may be stuck in a collective) and restarted on
        the next call.
        """
        self.start()
        name = getattr(fn, "__qualname__", repr(fn))
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(name, timeout_s or self.timeout_s)

    def _collect(self, name: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        while pending:
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.02):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "err", f"rank {rank} exited (code {proc.exitcode})"
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
            if pending and time.monotonic() > deadline:
                break
        if errors or pending:
            self._kill()
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            hung = f" (ranks {sorted(pending)} did not answer)" if pending else ""
            raise RankError(f"{name} failed on ranks {sorted(errors)}{hung}:\n{detail}")
        if pending:
            raise TimeoutError(
                f"{name}: ranks {sorted(pending)} of {self.world_size} did not finish within "
                f"{timeout_s:.0f}s (a collective that some rank never joined?)"
            )
        return results


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args, timeout_s: float = DEFAULT_TIMEOUT_S,
                 **kwargs) -> list[Any]:
    """One-shot helper: start a world, run one check, tear it down."""
    with GlooWorld(world_size, timeout_s=timeout_s) as world:
        return world.run(fn, *args, **kwargs)
