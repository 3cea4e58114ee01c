"""One measured training step on a rank, for bench/bench_step_anatomy.py: its collectives
(bench/anatomy_comm.py), host reads and FLOPs (``measure_step``), and the single-process reference
FLOPs (``reference_flops``).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from typing import Any

import torch
import torch.distributed as dist

from bench.anatomy_comm import KINDS, SKIP_FRAMES, CommCounter, DispatchRecorder


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

    tests/support/host_reads.py counts through a TorchFunctionMode, which the autograd engine does not
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
                from tests.support.host_reads import _short_name

                frame = sys._getframe(1)
                while frame is not None and any(s in frame.f_code.co_filename for s in SKIP_FRAMES):
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
        from tests.support.host_reads import HOST_READS

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
# Reads inside custom-op bodies, which tests/support/host_reads.py never sees (a TorchFunctionMode is off
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
    """One step counted the way tests/support/host_reads.py does (its TorchFunctionMode), same windows."""
    from tests.support.host_reads import HostReadCounter, split_reads

    counter = HostReadCounter()
    windows = StepWindows(trainer, counter.__enter__, lambda: counter.__exit__(None, None, None))
    trainer.train_step()
    windows.close()
    others, ep = split_reads(counter.where)
    return {"total": sum(others.values()) + ep, "ep_split_reads": ep, "where": others}


def measure_step(config, warmup_steps: int = 1) -> dict:
    """Run ``warmup_steps`` steps and one step counted by tests/support/host_reads.py's own counter, then
    measure one step; returns this rank's anatomy (plain data)."""
    from tests.support.host_reads import split_reads
    from xorl.parallel.data_parallel import decoder_layers
    from xorl.trainer.trainer import Trainer

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
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()
    flops = flop_counter()
    with flops:
        trainer.train_step()
    return {"flops": flops.get_total_flops(), "lm_head_flops": lm_head_flops(flops.get_flop_counts())}
