"""A fatal error after the process group started: shown once, by the rank that had it, and the job ends.

Before this, a rank that hit a data error at step 20 printed nothing (only rank 0 spoke) or waited
for rank 0 to speak, then ``sys.exit`` joined the background checkpoint threads and
``destroy_process_group`` waited for peers still inside a collective: the job outlived
``collective_timeout_s`` by minutes.

What happens now (``exit_fatal``):
- The failing rank counts itself in the c10d store (torchrun's agent hosts it, so it outlives any
  worker): the first rank to count prints its error, every later one is an echo of it (the same
  data error on every rank, or a peer's collective failing because the first rank left) and stays
  quiet. The store has a short timeout: with the store gone, a rank prints rather than say nothing.
- It then leaves at once (``os._exit`` after flushing): no join of the background checkpoint
  thread, no process-group teardown that would wait for peers. A checkpoint being written is left
  as ``step_N.tmp`` (``latest`` still names the previous one; the next resume removes it).
- The other ranks: under torchrun, the launcher stops them as soon as one worker exits; without it
  (or on other nodes) their next collective fails within ``collective_timeout_s`` (gloo fails at
  once when a peer's connection closes), and they take this same path quietly.

Exit codes: 2 a config or data error, 1 anything else (checkpoint errors, a non-finite loss, a
failed collective); 75 is a preempted run (xorl/run/preemption.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

FATAL_KEY = "xorl/fatal_errors"
STORE_TIMEOUT_S = 10.0


def first_to_fail() -> bool:
    """True for the first rank of the job to report a fatal error (always, without a process group)."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return True
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        return store.add(FATAL_KEY, 1) == 1
    except Exception:  # noqa: BLE001 - no store to ask: better twice than never
        return True


def collective_timeout(error: BaseException, timeout_s: float) -> str | None:
    """The one line for a collective that timed out (gloo's 'Timed out waiting ...ms', NCCL's watchdog
    'timeout'), else None. Why no traceback: the stack only says which collective waited; what the
    user needs is that a peer stalled, and its own error, if it had one, is printed by that rank."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - torch without distributed
        DistError = RuntimeError  # noqa: N806
    lowered = text.lower()
    gloo = isinstance(error, RuntimeError) and "Timed out waiting" in text
    nccl = "collective operation timeout" in lowered or (
        isinstance(error, DistError) and ("timed out" in lowered or "timeout" in lowered))
    if not (gloo or nccl):
        return None
    return (f"a collective did not complete within train.collective_timeout_s={timeout_s:g} s: another rank "
            f"stalled (or stopped without an error of its own); if one failed, its error is printed above. "
            f"({type(error).__name__}: {first})")


def another_rank_failed(within_s: float = 3.0) -> bool:
    """Whether a rank of this job already reported a fatal error (counted in the store by
    ``first_to_fail``). Asked from a helper thread and given up after ``within_s`` (False): the store
    may be gone with its host, and the store's own timeout is the job's collective timeout."""
    answer: list[bool] = []

    def ask() -> None:
        try:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:
                answer.append(bool(dist.distributed_c10d._get_default_store().check([FATAL_KEY])))
        except Exception:  # noqa: BLE001 - no store to ask: not known to have failed
            pass

    asking = threading.Thread(target=ask, name="xorl-fatal-check", daemon=True)
    asking.start()
    asking.join(within_s)
    return bool(answer and answer[0])


def exit_quietly_after_another_rank(code: int = 1) -> None:
    """This rank is being stopped because another one failed (its error is printed): leave at once."""
    write_error_file("stopped because another rank failed (its error is printed above)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def exit_fatal(message: str, code: int, with_traceback: bool = False) -> None:
    """Print ``message`` if this rank failed first, point torchrun's error file at it, leave now."""
    rank = _rank()
    first = first_to_fail()
    if first:
        who = f"xorl-train (rank {rank})" if _world_size() > 1 else "xorl-train"
        if with_traceback:
            sys.stderr.write(traceback.format_exc())
        print(f"{who}: {message}", file=sys.stderr, flush=True)
    # torchrun's summary: a pointer, so the message itself appears once in the log
    write_error_file(f"the error printed above by xorl-train (rank {rank})" if first else
                     "stopped because another rank failed (its error is printed above)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def write_error_file(pointer: str) -> None:
    """torchrun's failure summary shows this per failed rank instead of "To enable traceback see ..."."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    record = {"message": {"message": pointer, "extraInfo": {"py_callstack": pointer,
                                                            "timestamp": str(int(time.time()))}}}
    # Written whole or not at all: torchrun may stop this rank (its peer failed) mid-write, and an empty
    # or cut file makes torchrun's own summary fail on the JSON (a JSONDecodeError instead of the exit
    # codes), seen under load.
    partial = f"{error_file}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(record, f)
        os.replace(partial, error_file)
    except OSError:
        pass
