"""Counting one training step's collectives for bench/bench_step_anatomy.py: every ProcessGroup call
and functional collective with the bytes this rank sends (``CommCounter``), and the expert-parallel
dispatch against its deduplicated minimum (``DispatchRecorder``). The byte conventions are in
bench_step_anatomy.py's docstring.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from xorl._torch_compat import resolve_process_group

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p_send", "p2p_recv", "broadcast",
         "barrier", "other")


# ----------------------------------------------------------------------------------------------
# Counting collectives
# ----------------------------------------------------------------------------------------------
def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sum_bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return _nbytes(tensors)
    total = 0
    for t in tensors or ():
        total += _sum_bytes(t) if isinstance(t, (list, tuple)) else _nbytes(t)
    return total


def _a2a_single_bytes(inp: torch.Tensor, input_splits, size: int, me: int) -> int:
    """Bytes of the rows sent to the other ranks of an all_to_all_single."""
    if inp.numel() == 0:
        return 0
    if not input_splits:
        return _nbytes(inp) * (size - 1) // size
    row = _nbytes(inp) // inp.shape[0]
    return sum(int(n) * row for r, n in enumerate(input_splits) if r != me)


# ProcessGroup method -> (kind, bytes sent by this rank); args are the method's, without self.
def _pg_rules():
    def first(args):
        return args[0]

    return {
        "allreduce": ("all_reduce", lambda pg, a: _sum_bytes(first(a))),
        "allreduce_coalesced": ("all_reduce", lambda pg, a: _sum_bytes(first(a))),
        "allgather": ("all_gather", lambda pg, a: _sum_bytes(a[1])),
        "all_gather_single": ("all_gather", lambda pg, a: _nbytes(a[1])),
        "_allgather_base": ("all_gather", lambda pg, a: _nbytes(a[1])),
        "allgather_coalesced": ("all_gather", lambda pg, a: _sum_bytes(a[1])),
        "allgather_into_tensor_coalesced": ("all_gather", lambda pg, a: _sum_bytes(a[1])),
        "all_gather_single_coalesced": ("all_gather", lambda pg, a: _sum_bytes(a[1])),
        "reduce_scatter": ("reduce_scatter", lambda pg, a: _sum_bytes(a[1])),
        "reduce_scatter_single": ("reduce_scatter", lambda pg, a: _nbytes(a[1])),
        "_reduce_scatter_base": ("reduce_scatter", lambda pg, a: _nbytes(a[1])),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda pg, a: _sum_bytes(a[1])),
        "reduce_scatter_single_coalesced": ("reduce_scatter", lambda pg, a: _sum_bytes(a[1])),
        "all_to_all_single": ("all_to_all", lambda pg, a: _a2a_single_bytes(a[1], a[3], pg.size(), pg.rank())),
        "alltoall_base": ("all_to_all", lambda pg, a: _a2a_single_bytes(a[1], a[3], pg.size(), pg.rank())),
        "alltoall": ("all_to_all", lambda pg, a: sum(_nbytes(t) for r, t in enumerate(a[1]) if r != pg.rank())),
        "send": ("p2p_send", lambda pg, a: _sum_bytes(first(a))),
        "recv": ("p2p_recv", lambda pg, a: 0),
        "recv_anysource": ("p2p_recv", lambda pg, a: 0),
        "broadcast": ("broadcast", lambda pg, a: _sum_bytes(first(a)) if _root(a) == pg.rank() else 0),
        "barrier": ("barrier", lambda pg, a: 0),
        "reduce": ("other", lambda pg, a: _sum_bytes(first(a))),
        "gather": ("other", lambda pg, a: _sum_bytes(a[1])),
        "scatter": ("other", lambda pg, a: _sum_bytes(a[1])),
    }


def _root(args) -> int:
    opts = args[1] if len(args) > 1 else None
    return getattr(opts, "rootRank", 0)


# Functional collectives (DTensor): op name -> (kind, bytes). Their args: (input(s), ..., group_name).
_FUNCOL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
# Frames that are the counting itself, not the code issuing the collective.
SKIP_FRAMES = ("/torch/", "bench_step_anatomy.py", "/bench/anatomy_", "host_reads.py")


@dataclass
class Event:
    kind: str
    nbytes: int
    group: tuple[int, ...]  # global ranks of the group
    site: str  # "file:function" of the innermost caller outside torch
    backward: bool  # issued by the autograd engine (backward or recompute)
    functional: bool = False  # a functional collective (seen by the dispatch mode), not a ProcessGroup call


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(s in frame.f_code.co_filename for s in SKIP_FRAMES):
        frame = frame.f_back
    if frame is None:
        return "torch"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


class CommCounter(TorchDispatchMode):
    """Records every collective while active: ProcessGroup methods wrapped, functional ops seen here."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    def _record(self, kind: str, nbytes: int, group_ranks: tuple[int, ...], functional: bool = False) -> None:
        self.events.append(Event(kind, int(nbytes), group_ranks, _site(),
                                 torch._C._current_graph_task_id() != -1, functional))

    def _wrap(self, original, kind: str, nbytes):
        counter = self

        def wrapper(pg, *args, **kwargs):
            if getattr(counter._local, "depth", 0) == 0:  # an outer call already counted this one
                counter._record(kind, nbytes(pg, args), tuple(dist.get_process_group_ranks(pg)))
            counter._local.depth = getattr(counter._local, "depth", 0) + 1
            try:
                return original(pg, *args, **kwargs)
            finally:
                counter._local.depth -= 1

        return wrapper

    def __enter__(self):
        from torch._C._distributed_c10d import ProcessGroup

        for name, (kind, nbytes) in _pg_rules().items():
            if name in ProcessGroup.__dict__:
                # The class's own descriptor, restored as it was (getattr would give the unbound
                # builtin, which no longer binds ``self`` once set back on the class).
                self._saved[name] = ProcessGroup.__dict__[name]
                setattr(ProcessGroup, name, self._wrap(getattr(ProcessGroup, name), kind, nbytes))
        return super().__enter__()

    def __exit__(self, *exc):
        from torch._C._distributed_c10d import ProcessGroup

        for name, original in self._saved.items():
            setattr(ProcessGroup, name, original)
        self._saved = {}
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("_c10d_functional", "_c10d_functional_autograd"):
            kind = _FUNCOL.get(func._opname)
            if kind is not None:
                self._record_funcol(func._opname, kind, args, kwargs)
        return func(*args, **kwargs)

    def _record_funcol(self, name: str, kind: str, args, kwargs) -> None:
        group_name = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
        group = resolve_process_group(group_name)
        ranks = tuple(dist.get_process_group_ranks(group))
        if kind == "all_to_all":
            nbytes = _a2a_single_bytes(args[0], args[2], len(ranks), dist.get_rank(group))
        elif kind == "broadcast":
            nbytes = _sum_bytes(args[0]) if args[1] == dist.get_rank(group) else 0
        else:
            nbytes = _sum_bytes(args[0])
        self._record(kind, nbytes, ranks, functional=True)


# ----------------------------------------------------------------------------------------------
# Expert-parallel dispatch: measured bytes and the deduplicated minimum
# ----------------------------------------------------------------------------------------------
class DispatchRecorder:
    """Wraps ``expert_parallel_moe`` as xorl.nn.moe calls it; per forward call: the router's expert
    ids and the all_to_all events of the call.

    xorl/nn/ep_dispatch.py's expert-parallel forward issues, in this order: the counts (an even all_to_all of
    xorl's custom op), each slot's metadata (24 bytes a slot, custom op), the hidden rows (torch's
    functional all_to_all: the only functional one) and the combine (custom op). The hidden-row
    dispatch is therefore the functional all_to_all of the call, and the metadata the first
    ProcessGroup all_to_all after the counts.
    """

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter
        self.calls: list[dict] = []
        self._original = None

    def __enter__(self):
        import xorl.nn.moe as moe

        self._original = original = moe.expert_parallel_moe
        recorder = self

        def wrapped(x, expert_ids, weights, experts, num_experts, group, overlap=None):
            start = len(recorder.counter.events)
            out = original(x, expert_ids, weights, experts, num_experts, group, overlap=overlap)
            if group is not None and dist.get_world_size(group) > 1:
                a2a = [e for e in recorder.counter.events[start:] if e.kind == "all_to_all" and not e.backward]
                rows = [e for e in a2a if e.functional]
                custom = [e for e in a2a if not e.functional]
                recorder.calls.append({
                    "expert_ids": expert_ids.detach().clone(),  # no host read inside the step
                    "row_bytes": x.shape[-1] * x.element_size(),
                    "num_experts": num_experts,
                    "ep_size": dist.get_world_size(group),
                    "ep_rank": dist.get_rank(group),
                    "dispatch_bytes": sum(e.nbytes for e in rows),
                    "metadata_bytes": custom[1].nbytes if len(custom) == 3 else None,
                    "combine_bytes": custom[2].nbytes if len(custom) == 3 else None,
                    "all_to_alls": len(a2a),
                })
            return out

        moe.expert_parallel_moe = wrapped
        return self

    def __exit__(self, *exc):
        import xorl.nn.moe as moe

        moe.expert_parallel_moe = self._original

    def summary(self) -> dict:
        """Measured dispatch bytes; what one row per routing slot would send; the minimum (one row
        per (token, destination rank)); the metadata bytes against 24 bytes per slot sent away."""
        measured = topk = minimum = metadata = metadata_expected = combine = 0
        for call in self.calls:
            ids, ep, me = call["expert_ids"].long(), call["ep_size"], call["ep_rank"]
            dest = ids // (call["num_experts"] // ep)  # [tokens, k] destination EP rank
            away = int((dest != me).sum())
            topk += away * call["row_bytes"]
            hit = torch.zeros(ids.shape[0], ep, dtype=torch.bool)
            hit.scatter_(1, dest, True)
            hit[:, me] = False
            minimum += int(hit.sum()) * call["row_bytes"]
            measured += call["dispatch_bytes"]
            metadata += call["metadata_bytes"] or 0
            metadata_expected += away * 24
            combine += call["combine_bytes"] or 0
        return {"calls": len(self.calls), "measured_bytes": measured, "topk_rows_bytes": topk,
                "dedup_min_bytes": minimum, "combine_bytes": combine, "metadata_bytes": metadata,
                "metadata_expected_bytes": metadata_expected,
                "all_to_alls_per_call": sorted({c["all_to_alls"] for c in self.calls})}
