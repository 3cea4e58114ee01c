"""One run per output_dir: an exclusive ``flock`` on ``output_dir/.lock``, held by rank 0.

Before this, two runs started into one folder both wrote checkpoints and metrics.jsonl: one crashed
in its save, the other finished with a quarter of its metrics rows, and nothing told whose
checkpoints were whose.

- Rank 0 takes the lock after the process group starts and before anything is written, and keeps it
  until its process exits: the kernel releases a flock when its holder dies (kill -9, a lost node
  that takes its processes with it), so a stale lock from a dead run never blocks the next one. The
  file itself stays (removing a lock file races with the next taker); it records the holder's host,
  process id and start time for the refusal message, and xorl's folder checks ignore it.
- Rank 0 broadcasts the verdict, so on any number of nodes every rank stops with the same message
  (only rank 0 touches the file: flock on a shared filesystem is honoured between nodes on NFSv4
  and Lustre mounted with ``flock``; one holder avoids relying on more than that).
- ``holder()`` looks without taking it (``prepare_run``, ``xorl-train --check``): the usual second
  run is refused in a second, before any process group; the lock itself settles two runs started
  in the same second.
- Within one process the lock is reentrant: a test (or a notebook) that builds several Trainers on
  one folder one after another is one holder, not two runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from xorl.run.folder import LOCK_NAME

ATTEMPTS = 10
_held: dict[str, int] = {}  # realpath of output_dir -> the open, locked descriptor of this process


def _lock_path(output_dir: str) -> str:
    return os.path.join(output_dir, LOCK_NAME)


def _describe(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {info['pid']} on host {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def _refusal(output_dir: str, path: str) -> str:
    return (f"train.output_dir={output_dir!r} is in use by another run ({_describe(path)}; it holds {path}): two "
            "runs in one folder would mix their checkpoints and metrics. Wait for it to end, stop it, or choose "
            "another train.output_dir")


def holder(output_dir: str) -> str | None:
    """The refusal message if another process holds the folder's lock, else None (takes nothing)."""
    path = _lock_path(output_dir)
    if os.path.realpath(output_dir) in _held or not os.path.isfile(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _refusal(output_dir, path)
    except OSError:
        return None  # a filesystem without flock: nothing to learn here
    finally:
        os.close(fd)
    return None


def acquire(output_dir: str) -> str | None:
    """Take the lock for this process (kept until it exits); the refusal message if another holds it."""
    key = os.path.realpath(output_dir)
    if key in _held:
        return None
    os.makedirs(output_dir, exist_ok=True)
    path = _lock_path(output_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(ATTEMPTS):  # another start's holder() may hold a shared lock for a moment
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == ATTEMPTS - 1:
                os.close(fd)
                return _refusal(output_dir, path)
            time.sleep(0.1)
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    _held[key] = fd
    return None


def hold(output_dir: str, device) -> None:
    """Collective: rank 0 takes the lock, every rank raises the same ConfigError if it could not."""
    import torch
    import torch.distributed as dist

    from xorl.config.errors import ConfigError

    refused = acquire(output_dir) if dist.get_rank() == 0 else None
    flag = torch.tensor([1 if refused else 0], dtype=torch.int32, device=device)
    if dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    if int(flag.item()):  # start-up, not the training step
        raise ConfigError(refused or _refusal(output_dir, _lock_path(output_dir)))


def release(output_dir: str) -> None:
    """Give the lock back before the process exits (tests); exiting releases it anyway."""
    fd = _held.pop(os.path.realpath(output_dir), None)
    if fd is not None:
        os.close(fd)
