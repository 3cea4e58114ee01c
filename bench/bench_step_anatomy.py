"""The anatomy of one training step: collectives, bytes sent, host syncs and FLOPs per rank (exact, CPU).

Every layout of examples/*.yaml is scaled down to the tiny model of tests/parity_runs.py (hidden
32, 4 layers, vocab 272; the MoE layouts 8 experts, top-2) and its parallel dims to 2 (expert
parallel in proportion), and runs the real Trainer on gloo ranks. After one warm-up step, ONE step
(``Trainer.train_step``) is measured on every rank:

- collectives, by kind, with the bytes this rank sends. Every torch.distributed call reaches a
  ``ProcessGroup`` method (FSDP2's ``all_gather_single`` / ``reduce_scatter_single``, xorl's ring
  ``batch_isend_irecv``, the all_to_alls inside xorl's custom ops, ...); those methods are wrapped
  for the step. Functional collectives (DTensor redistributions, the EP dispatch of the hidden
  rows) call the process group from C++: a TorchDispatchMode counts the ``_c10d_functional`` ops.
  Bytes sent, per kind (the payload convention, not a wire model; each event also records its
  group size, from which ring wire bytes follow):

  ========================  ===========================================================
  all_reduce                the tensor's bytes
  all_gather                the input (this rank's shard)
  reduce_scatter            the input (the full unreduced buffer)
  all_to_all                the input rows sent to other ranks (own split excluded)
  p2p_send / p2p_recv       the sent tensor's bytes / 0 (a receive sends nothing)
  broadcast                 the tensor's bytes on the root, 0 elsewhere
  barrier, other            0 / the input's bytes
  ========================  ===========================================================

- host reads of device values (tests/host_reads.py's TorchFunctionMode): from the first forward
  to the first optimizer step, and after the last optimizer step to the end of the step (the
  step's one read of its results); the optimizer steps themselves read CPU step counters only.
  Reads that cost nothing on a GPU (checks that return early for CUDA tensors, CPU reference
  kernels) are left out, as tests/test_host_syncs.py does. The anchor is the minimum: the end
  read plus expert parallelism's split sizes, one per MoE layer per microbatch forward.
- FLOPs (torch.utils.flop_counter.FlopCounterMode around the step): matmuls (aten mm / bmm /
  addmm ...) and xorl's grouped expert GEMMs (a formula registered here: 2 x rows x in x out per
  product). The attention core runs in xorl custom ops (flash_attn, ring_attention) and is not
  counted: its balance under context parallelism is measured exactly in bench_context_parallel.
  The ideal per rank is the same config's single-process FLOPs of the same global batch divided
  by the world size (every dim splits the work); the ratio shows padding, recompute differences,
  pipeline stage imbalance and expert load imbalance.

Rows per layout: each kind's collectives per step (max over ranks; anchor: decoder layers on the
rank x microbatches, so the ratio is the count per layer per microbatch) and bytes sent (anchor:
the model's fp32 parameter bytes), the host reads, and FLOPs max-rank / ideal. Targets:

- lm_head FLOPs per TP rank against 1/TP of the lm_head FLOPs of its data (vocab-parallel head);
- all-reduces of replicated-parameter gradients under TP (``sum_tp_partial_grads``): 1 per step;
- expert-parallel dispatch bytes (the hidden rows) against the deduplicated minimum: a token
  routed to several experts on one destination rank sent there once (from the router's expert ids
  and the expert -> rank map, own rank excluded); target <= 1.05. The 24 bytes of metadata per
  routing slot that travel beside the rows are reported separately, against their exact count.

Counts and bytes are exact on any device (fp32 here; bf16 compute on a GPU halves FSDP's
all-gather and the activation bytes). ``python bench/bench_step_anatomy.py`` is ``python -m bench --only
step_anatomy``: the rows printed, and the results file written to bench/results/ (bench/runner.py).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, for bench and xorl
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.context import BenchContext, Result  # noqa: E402
from xorl._torch_compat import resolve_process_group  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SCALED_DIM = 2  # every parallel dim above 1 becomes 2
MICROBATCHES = 2  # gradient accumulation steps per data-parallel rank
MOE_EXPERTS, MOE_TOP_K = 8, 2
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
_SKIP_FRAMES = ("/torch/", "bench_step_anatomy.py", "host_reads.py")


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
    while frame is not None and any(s in frame.f_code.co_filename for s in _SKIP_FRAMES):
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
# FLOPs
# ----------------------------------------------------------------------------------------------
def _grouped_gemm_flops(x_shape, w_shape, group_sizes_shape, backend, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * w_shape[1] * w_shape[2]


def _grouped_gemm_backward_flops(dy_shape, x_shape, w_shape, group_sizes_shape, backend, need_dx, need_dw,
                                 out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * w_shape[1] * w_shape[2] * (int(need_dx) + int(need_dw))


def flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    import xorl_kernels.expert_gemm.op  # noqa: F401 - registers torch.ops.xorl.grouped_gemm

    mapping = {torch.ops.xorl.grouped_gemm: _grouped_gemm_flops,
               torch.ops.xorl.grouped_gemm_backward: _grouped_gemm_backward_flops}
    return FlopCounterMode(display=False, custom_mapping=mapping)


def lm_head_flops(counts: dict[str, dict]) -> int:
    """FLOPs of the head and the loss (forward and backward): the step's total less each model part's
    decoder stack (``<Root>.model``). Why not the ``lm_head`` module's own count: the fused loss
    (model.fused_loss) multiplies by the head's weight without calling the module."""
    total = sum(counts.get("Global", {}).values())
    stacks = sum(sum(v.values()) for name, v in counts.items() if name.count(".") == 1 and name.endswith(".model"))
    return total - stacks


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


# ----------------------------------------------------------------------------------------------
# One measured step on a rank
# ----------------------------------------------------------------------------------------------
def _group_names(state) -> dict[tuple[int, ...], str]:
    names: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for short in ("tp", "ring", "ulysses", "cp", "dp_shard", "dp_replicate", "dp", "dp_shard_cp", "dp_cp", "pp",
                  "ep", "ep_fsdp"):
        group = getattr(state, f"{short}_group", None)
        if group is not None:
            names[tuple(dist.get_process_group_ranks(group))].append(short)
    return {ranks: "=".join(n) + (" (1 rank)" if len(ranks) == 1 else "") for ranks, n in names.items()}


class TensorReads:
    """Host reads by Tensor method, counted in any context while ``active``.

    tests/host_reads.py counts through a TorchFunctionMode, which the autograd engine does not
    carry into backward: reads in backward hooks, custom backward functions and activation
    checkpointing's recompute escape it. Here the same methods (host_reads.HOST_READS) are wrapped
    on torch.Tensor itself, attributed to the reading code the same way, and classified by
    host_reads.split_reads.
    """

    def __init__(self) -> None:
        self.where: Counter = Counter()
        self.active = False
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    def _wrap(self, name: str, original):
        reads = self

        def wrapper(tensor, *args, **kwargs):
            outer = getattr(reads._local, "depth", 0) == 0
            if reads.active and outer:
                from tests.host_reads import _short_name

                frame = sys._getframe(1)
                while frame is not None and any(s in frame.f_code.co_filename for s in _SKIP_FRAMES):
                    frame = frame.f_back
                if frame is not None:
                    reads.where[(_short_name(frame.f_code.co_filename), frame.f_code.co_name, name)] += 1
            reads._local.depth = getattr(reads._local, "depth", 0) + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                reads._local.depth -= 1

        return wrapper

    def __enter__(self):
        from tests.host_reads import HOST_READS

        for name in sorted(HOST_READS):
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            if original is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved = {}


_MISSING = object()
# Reads inside custom-op bodies, which tests/host_reads.py never sees (a TorchFunctionMode is off
# inside an op it handed on), that run only for CPU tensors: the CPU range check of the expert ids
# (``if not expert_ids.is_cuda``; host_reads.CPU_ONLY names it by its former function).
CPU_ONLY_INSIDE_OPS = {("moe_permute/op.py", "_permute_op")}


class StepWindows:
    """Turns a counter on from the first forward of a step to the first optimizer step, and again
    from the last optimizer step to the end of the step (``close``)."""

    def __init__(self, trainer, on, off) -> None:
        self.on, self.off, self.active, self.done = on, off, False, False
        self.hooks = [part.register_forward_pre_hook(self._start, with_kwargs=True, prepend=True)
                      for part in trainer.parts]
        self.hooks.append(trainer.optimizers[0].register_step_pre_hook(self._stop))
        self.hooks.append(trainer.optimizers[-1].register_step_post_hook(self._restart))

    def _start(self, *_args):
        if not self.active and not self.done:
            self.active = True
            self.on()

    def _stop(self, *_args):
        if self.active:
            self.off()
            self.active, self.done = False, True

    def _restart(self, *_args):
        self.done = False
        self._start()

    def close(self) -> None:
        self._stop()
        for hook in self.hooks:
            hook.remove()


def host_reads_py_step(trainer) -> dict:
    """One step counted the way tests/host_reads.py does (its TorchFunctionMode), same windows."""
    from tests.host_reads import HostReadCounter, split_reads

    counter = HostReadCounter()
    windows = StepWindows(trainer, counter.__enter__, lambda: counter.__exit__(None, None, None))
    trainer.train_step()
    windows.close()
    others, ep = split_reads(counter.where)
    return {"total": sum(others.values()) + ep, "ep_split_reads": ep, "where": others}


def measure_step(config, warmup_steps: int = 1) -> dict:
    """Run ``warmup_steps`` steps and one step counted by tests/host_reads.py's own counter, then
    measure one step; returns this rank's anatomy (plain data)."""
    from tests.host_reads import split_reads
    from xorl.plans.data_parallel import decoder_layers
    from xorl.trainer import Trainer

    trainer = Trainer(config)
    for _ in range(warmup_steps):
        trainer.train_step()
    state = trainer.state
    seen_by_host_reads_py = host_reads_py_step(trainer)

    reads = TensorReads()
    windows = StepWindows(trainer, lambda: setattr(reads, "active", True), lambda: setattr(reads, "active", False))
    comms = CommCounter()
    flops = flop_counter()
    dispatch = DispatchRecorder(comms)
    with reads, comms, dispatch, flops:
        trainer.train_step()
        windows.close()
    others, ep_reads = split_reads({k: v for k, v in reads.where.items() if k[:2] not in CPU_ONLY_INSIDE_OPS})

    groups = _group_names(state)
    by_kind: dict[str, list[int]] = {k: [0, 0] for k in KINDS}
    sites: Counter = Counter()
    for e in comms.events:
        by_kind[e.kind][0] += 1
        by_kind[e.kind][1] += e.nbytes
        sites[f"{e.kind} on {groups.get(e.group, str(list(e.group)))} by {e.site}"
              f"{' (backward)' if e.backward else ''}"] += 1
    counts = flops.get_flop_counts()
    layers = sum(len(decoder_layers(part)) for part in trainer.parts)
    has_head = any(getattr(part, "lm_head", None) is not None for part in trainer.parts)
    tp_partial = [e for e in comms.events if e.site.endswith(":sum_tp_partial_grads")]
    return {
        "rank": dist.get_rank(),
        "collectives": {k: v[0] for k, v in by_kind.items()},
        "bytes": {k: v[1] for k, v in by_kind.items()},
        "sites": dict(sites.most_common()),
        "flops": flops.get_total_flops(),
        "lm_head_flops": lm_head_flops(counts) if has_head else 0,
        "has_lm_head": has_head,
        "host_reads": sum(others.values()) + ep_reads,
        "host_reads_where": {f"{k}": v for k, v in others.items()},
        "ep_split_reads": ep_reads,
        "host_reads_py": seen_by_host_reads_py,
        "layers": layers,
        "microbatches": config.train.gradient_accumulation_steps,
        "tp_partial_all_reduces": len(tp_partial),
        "tp_partial_on_tp": all(len(e.group) == state.tp_size for e in tp_partial),
        "dispatch": dispatch.summary(),
        "sizes": {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "cp": state.cp_size,
                  "ep": state.ep_size, "dp_cp": state.dp_cp_size},
        "num_parameters": trainer.num_parameters,
    }


def reference_flops(config) -> dict:
    """Single-process FLOPs (total, lm_head) of one measured step of ``config`` (after a warm-up)."""
    from xorl.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()
    flops = flop_counter()
    with flops:
        trainer.train_step()
    return {"flops": flops.get_total_flops(), "lm_head_flops": lm_head_flops(flops.get_flop_counts())}


# ----------------------------------------------------------------------------------------------
# The example layouts, scaled down
# ----------------------------------------------------------------------------------------------
_DIMS = ("data_parallel_replicate_size", "data_parallel_shard_size", "tensor_parallel_size",
         "pipeline_parallel_size", "ulysses_parallel_size", "ringattn_parallel_size")
_EP_FOLD = ("data_parallel_shard_size", "ulysses_parallel_size", "ringattn_parallel_size", "tensor_parallel_size")
_KEPT = ("data_parallel_mode", "sequence_parallel", "pipeline_parallel_schedule", "virtual_pipeline_stages",
         "activation_checkpointing", "fsdp_reshard_after_forward")


@dataclass
class Layout:
    name: str  # the example's file name, without .yaml
    model_type: str
    world: int
    train: dict[str, Any]  # the scaled parallel sizes and the example's other parallel settings
    original: dict[str, int] = field(default_factory=dict)  # the example's sizes

    @property
    def dp(self) -> int:
        return self.train["data_parallel_replicate_size"] * self.train["data_parallel_shard_size"]

    def label(self) -> str:
        short = {"data_parallel_replicate_size": "rep", "data_parallel_shard_size": "fsdp",
                 "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "ulysses_parallel_size": "ulysses",
                 "ringattn_parallel_size": "ring", "expert_parallel_size": "ep"}
        dims = [f"{short[k]}{self.train[k]}" for k in short if self.train.get(k, 1) > 1]
        if self.train.get("sequence_parallel") and self.train["tensor_parallel_size"] > 1:
            dims[dims.index(f"tp{self.train['tensor_parallel_size']}")] += "+sp"
        if self.train["pipeline_parallel_size"] > 1:
            dims.append(self.train["pipeline_parallel_schedule"])
        return " x ".join(dims) or "one rank"


def make_layout(name: str, model_type: str, **sizes) -> Layout:
    """A layout by hand (tests): the given parallel sizes and settings, the rest at their defaults."""
    train = {k: 1 for k in _DIMS}
    train.update(data_parallel_mode="fsdp2", sequence_parallel=False, pipeline_parallel_schedule="1F1B",
                 virtual_pipeline_stages=1, activation_checkpointing=False, fsdp_reshard_after_forward="default")
    train.update(sizes)
    train["gradient_accumulation_steps"] = MICROBATCHES
    return Layout(name, model_type, math.prod(train[k] for k in _DIMS), train, {})


def scale_example(path: Path) -> Layout:
    """The example's layout with every parallel dim above 1 set to 2 (EP in proportion to its fold)."""
    from xorl.config import load_config

    t = load_config(str(path)).train
    original = {k: getattr(t, k) for k in (*_DIMS, "expert_parallel_size")}
    train = {k: (SCALED_DIM if original[k] > 1 else 1) for k in _DIMS}
    if original["expert_parallel_size"] > 1:
        fold = math.prod(original[k] for k in _EP_FOLD)
        scaled_fold = math.prod(train[k] for k in _EP_FOLD)
        ep = original["expert_parallel_size"] * scaled_fold // fold
        if ep < 2 or scaled_fold % ep:
            raise ValueError(f"{path.name}: expert_parallel_size {original['expert_parallel_size']} does not scale")
        train["expert_parallel_size"] = ep
    train.update({k: getattr(t, k) for k in _KEPT})
    train["gradient_accumulation_steps"] = MICROBATCHES
    model_type = load_config(str(path)).model.model_type
    return Layout(path.stem, model_type, math.prod(train[k] for k in _DIMS), train, original)


def example_layouts() -> list[Layout]:
    return [scale_example(p) for p in sorted(EXAMPLES.glob("*.yaml"))]


def model_config(out: str, model_type: str, **train):
    from tests.parity_runs import tiny_config

    config = tiny_config(out, model_type, max_steps=2, warmup_steps=0, **train)
    if model_type == "qwen3_moe":
        config.model.num_experts, config.model.num_experts_per_tok = MOE_EXPERTS, MOE_TOP_K
    return config


def reference_config(out: str, layout: Layout):
    """One process, the same model, checkpointing and global batch."""
    train = {k: 1 for k in _DIMS}
    train.update(activation_checkpointing=layout.train["activation_checkpointing"],
                 gradient_accumulation_steps=MICROBATCHES * layout.dp)
    return model_config(out, layout.model_type, **train)


# ----------------------------------------------------------------------------------------------
# Running every layout, and the rows
# ----------------------------------------------------------------------------------------------
def measure_layout(layout: Layout, work_dir: str, world_of, references: dict | None = None) -> dict:
    """One layout: every rank's anatomy and the single-process reference FLOPs. ``world_of(n)``
    gives an n-rank GlooWorld (tests pass their shared worlds); ``references`` caches the
    single-process runs by (model, checkpointing, data ranks)."""
    references = {} if references is None else references
    key = (layout.model_type, layout.train["activation_checkpointing"], layout.dp)
    if key not in references:
        ref_dir = os.path.join(work_dir, f"ref-{len(references)}")
        references[key] = world_of(1).run(reference_flops, reference_config(ref_dir, layout))[0]
    config = model_config(os.path.join(work_dir, f"layout-{layout.name}"), layout.model_type, **layout.train)
    ranks = world_of(layout.world).run(measure_step, config)
    return {"layout": layout, "ranks": ranks, "reference": references[key]}


def measure_layouts(layouts: list[Layout], work_dir: str, timeout_s: float = 900) -> dict[str, dict]:
    """Every layout, on worlds started here (one per world size) and closed at the end."""
    from xorl.testing.multirank import GlooWorld

    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    worlds: dict[int, GlooWorld] = {}

    def world_of(n: int) -> GlooWorld:
        if n not in worlds:
            worlds[n] = GlooWorld(n, timeout_s=timeout_s, env=env)
        return worlds[n]

    references: dict[tuple, dict] = {}
    try:
        return {layout.name: measure_layout(layout, work_dir, world_of, references) for layout in layouts}
    finally:
        for world in worlds.values():
            world.close()


def _per_layer_mb(values: list[int], anchors: list[int]) -> float | None:
    """The count per decoder layer per microbatch, where every rank's divides evenly."""
    if all(a and v % a == 0 for v, a in zip(values, anchors)) and len({v // a for v, a in zip(values, anchors)}) == 1:
        return values[0] // anchors[0]
    return None


def layout_results(name: str, data: dict) -> list[Result]:
    layout: Layout = data["layout"]
    ranks, ref = data["ranks"], data["reference"]
    label = f"{name} [{layout.label()}]"
    first = ranks[0]
    model_bytes = first["num_parameters"] * 4
    anchors = [r["layers"] * r["microbatches"] for r in ranks]
    common = {"layout": layout.label(), "world": layout.world, "example_sizes": layout.original, "exact": True,
              "microbatches_per_rank": MICROBATCHES, "model_type": layout.model_type,
              "activation_checkpointing": layout.train["activation_checkpointing"]}
    results = []
    for kind in KINDS:
        counts = [r["collectives"][kind] for r in ranks]
        if not any(counts):
            continue
        sent = [r["bytes"][kind] for r in ranks]
        sites = {s: n for s, n in first["sites"].items() if s.startswith(kind + " ")}
        results.append(Result(
            name=f"{label}: {kind} per step", value=max(counts), unit="collectives",
            anchor="decoder layers on the rank x microbatches", anchor_value=max(anchors), higher_is_better=False,
            params={**common, "per_rank": counts, "per_layer_per_microbatch": _per_layer_mb(counts, anchors),
                    "rank0_sites": sites}))
        if any(sent):
            results.append(Result(
                name=f"{label}: {kind} bytes sent per step", value=max(sent), unit="bytes",
                anchor="model fp32 parameter bytes", anchor_value=model_bytes, higher_is_better=False,
                params={**common, "per_rank": sent}))
    flops = [r["flops"] for r in ranks]
    ideal = ref["flops"] / layout.world
    results.append(Result(
        name=f"{label}: matmul FLOPs per rank (max)", value=max(flops), unit="FLOP",
        anchor="single-process FLOPs of the global batch / world size", anchor_value=ideal, higher_is_better=False,
        params={**common, "per_rank": flops, "per_rank_over_ideal": [round(f / ideal, 4) for f in flops],
                "single_process": ref["flops"]}))
    moe = layout.model_type == "qwen3_moe" and layout.train.get("expert_parallel_size", 1) > 1
    # Activation checkpointing recomputes each MoE block's forward in backward, dispatch included,
    # so its split sizes are read again there: 2 reads per MoE layer per microbatch.
    from xorl.plans.data_parallel import checkpointing_mode

    passes = 1 if checkpointing_mode(layout.train["activation_checkpointing"]) == "none" else 2
    needed = [1 + (r["layers"] * r["microbatches"] * passes if moe else 0) for r in ranks]
    reads = [r["host_reads"] for r in ranks]
    results.append(Result(
        name=f"{label}: host reads per step", value=max(reads), unit="reads",
        anchor="the step's end read + EP split sizes (1 per MoE layer per microbatch forward, recompute included)",
        anchor_value=max(needed),
        higher_is_better=False,
        params={**common, "per_rank": reads, "ep_split_reads": [r["ep_split_reads"] for r in ranks],
                "rank0_where": first["host_reads_where"]}))
    if layout.train["tensor_parallel_size"] > 1:
        tp = layout.train["tensor_parallel_size"]
        head = [r["lm_head_flops"] for r in ranks if r["has_lm_head"]]
        data_ranks = first["sizes"]["dp_cp"]
        results.append(Result(
            name=f"{label}: lm_head FLOPs per TP rank", value=max(head), unit="FLOP",
            anchor="1/TP of the single-process lm_head FLOPs of the rank's data", higher_is_better=False,
            anchor_value=ref["lm_head_flops"] / data_ranks / tp,
            params={**common, "per_rank_with_head": head, "single_process": ref["lm_head_flops"], "tp": tp}))
        partial = [r["tp_partial_all_reduces"] for r in ranks]
        results.append(Result(
            name=f"{label}: replicated-gradient all-reduces over TP per step", value=max(partial),
            unit="collectives", anchor="one per step (sum_tp_partial_grads)", anchor_value=1, higher_is_better=False,
            params={**common, "per_rank": partial, "all_on_tp_group": all(r["tp_partial_on_tp"] for r in ranks)}))
    if moe:
        d = [r["dispatch"] for r in ranks]
        measured = sum(x["measured_bytes"] for x in d)
        results.append(Result(
            name=f"{label}: EP dispatch bytes (all ranks)", value=measured, unit="bytes",
            anchor="deduplicated minimum (each token once per destination rank)",
            anchor_value=sum(x["dedup_min_bytes"] for x in d), higher_is_better=False,
            params={**common, "per_rank": d, "topk_rows_bytes": sum(x["topk_rows_bytes"] for x in d),
                    "experts": MOE_EXPERTS, "top_k": MOE_TOP_K, "ep": layout.train["expert_parallel_size"]}))
        results.append(Result(
            name=f"{label}: EP dispatch metadata bytes (all ranks)", value=sum(x["metadata_bytes"] for x in d),
            unit="bytes", anchor="24 bytes per routing slot sent to another rank (weight, local expert, pair index)",
            anchor_value=sum(x["metadata_expected_bytes"] for x in d), higher_is_better=False,
            params={**common, "hidden_rows_bytes": measured}))
    return results


def run(ctx: BenchContext, layouts: list[Layout] | None = None, raw: dict | None = None) -> list[Result]:
    """Every example layout, scaled down, on gloo ranks (CPU; the figures are exact on any device)."""
    layouts = example_layouts() if layouts is None else layouts
    with tempfile.TemporaryDirectory(prefix="xorl-bench-step-anatomy-") as work_dir:
        measured = measure_layouts(layouts, work_dir)
    if raw is not None:
        raw.update(measured)
    return [r for name, data in measured.items() for r in layout_results(name, data)]


def main(argv: list[str] | None = None) -> int:
    """``python bench/bench_step_anatomy.py [--out DIR]``: this benchmark through bench's runner,
    which prints the rows and writes the usual results file."""
    from bench.runner import main as bench_main

    return bench_main(["--only", "step_anatomy", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
