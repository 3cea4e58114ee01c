"""Count the host reads of device values during a training step (a CPU stand-in for CUDA's sync check).

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` raises at every synchronising call. On CPU
nothing synchronises, so this counts the calls that would: every Tensor method that hands a value
to Python (.item(), .tolist(), .cpu(), .numpy(), float(t), int(t), bool(t), operator.index(t)),
through a TorchFunctionMode, between the first forward of the step and the optimizer step. The
batch the loader builds on the host before the first forward is not device data and is not in the
window. Module-level so the check travels to gloo ranks by pickle.
"""

from __future__ import annotations

import traceback
from collections import Counter

from torch.overrides import TorchFunctionMode

HOST_READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}


# Functions whose host reads run only on CPU tensors, so they cost nothing on a GPU run: value
# checks that return early for CUDA tensors, and the plain-torch references that dispatch picks only
# for CPU tensors (xorl_kernels: csrc, then Triton, on CUDA). The GPU check
# (scripts/gpu_check.sh, sync debug mode "error") covers the CUDA paths themselves.
# Files are named by their base name, or "<op folder>/<file>" inside xorl_kernels (whose op folders
# all hold an op.py and a reference.py).
CPU_ONLY = {
    ("attention/layout.py", "_check_cu_seqlens"),
    ("attention/layout.py", "_check_positions"),
    ("ring_step_kernel.py", "_local_boundaries"),
    ("ring_step_kernel.py", "_active_steps"),  # reads cu_seqlens only when it is on the host
    ("moe_permute/op.py", "permute_tokens"),
    ("moe_permute/routing.py", "_check_routing_args"),
    ("attention.py", "check_cu_seqlens"),
    # Called by the reference, and by the Triton path only for CPU group sizes (or with the debug
    # switch XORL_CHECK_GROUP_SIZES): device group sizes are never read on the host.
    ("expert_gemm/checks.py", "check_group_sizes_values"),
}
# torch's CPU flash kernel (the torch_cpu backend, picked for CPU tensors only) reads the document
# boundaries to call it per document.
CPU_ONLY_FILES = ("attention/reference.py", "expert_gemm/reference.py", "attention/cpu_flash.py")
# The one read the algorithm needs: the split sizes of the uneven expert-parallel all_to_all.
EP_SPLIT_SIZES = ("ep_dispatch.py", "_deduplicated_dispatch")  # the one read of the split sizes


def _short_name(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 and parts[-3] == "xorl_kernels" else parts[-1]


class HostReadCounter(TorchFunctionMode):
    """Counts host reads by (file, function, method) of the reading code (torch's own frames skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            frame = next(f for f in reversed(traceback.extract_stack()[:-1])
                         if "/torch/" not in f.filename and "host_reads.py" not in f.filename)
            self.where[(_short_name(frame.filename), frame.name, func.__name__)] += 1
        return func(*args, **(kwargs or {}))


def split_reads(where: dict) -> tuple[dict, int]:
    """(reads a GPU run would make outside the EP split sizes, EP split-size reads)."""
    others, ep = {}, 0
    for (file, function, method), count in where.items():
        if (file, function) in CPU_ONLY or file in CPU_ONLY_FILES:
            continue
        if (file, function) == EP_SPLIT_SIZES:
            ep += count
        else:
            others[f"{file}:{function} {method}"] = count
    return others, ep


def host_reads_in_step(config, steps: int = 2) -> dict:
    """Train ``steps`` steps; return the host reads of the last one between first forward and optimizer step."""
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    counter = HostReadCounter()
    state = {"active": False}

    def start(module, args, kwargs):
        if not state["active"]:
            state["active"] = True
            counter.__enter__()

    def stop(optimizer, args, kwargs):
        if state["active"]:
            counter.__exit__(None, None, None)
            state["active"] = False

    for _ in range(steps - 1):
        trainer.train_step()
    hooks = [part.register_forward_pre_hook(start, with_kwargs=True, prepend=True) for part in trainer.parts]
    hooks += [opt.register_step_pre_hook(stop) for opt in trainer.optimizers[:1]]
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    return split_reads(counter.where)
