"""Replicated parameters (``replicate_on_tp``): the parameters TP does not shard (norms, embeddings,
lm_head, q/k norms) become ``Replicate()`` DTensors on the TP mesh, because FSDP2 then shards
every parameter on the dp mesh into one 2-D (dp, tp) layout and clip-grad / foreach optimizers
need them on one mesh. Inside forward the owning module computes with the local tensor
(``param.to_local()``, differentiable back to the DTensor), swapped into its parameter slot for
the duration of the call (the ``TPReplicated`` class the module is given, as FSDP2 gives its own).
Where a rank's use sees only part of the data (RMSNorm on a sequence
shard, q/k norms on this rank's heads) each rank's gradient is a partial sum: those parameters
are listed in a ``TPPartialGrads`` and ``sum_tp_partial_grads`` adds them up over TP once per
optimizer step, in one flattened all-reduce (instead of one per parameter per microbatch).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from xorl.nn.tp_comm import TPGroup


def replicated_param(param: nn.Parameter, tp_mesh, memo: dict[int, nn.Parameter]) -> nn.Parameter:
    """``param`` as a Replicate DTensor parameter on ``tp_mesh``; one per original (``memo``: tied weights)."""
    new = memo.get(id(param))
    if new is None:
        new = nn.Parameter(DTensor.from_local(param.detach(), tp_mesh, [Replicate()], run_check=False),
                           requires_grad=param.requires_grad)
        memo[id(param)] = new
    return new


class TPPartialGrads:
    """Replicated parameters whose per-rank gradient is a partial sum over the TP ranks.

    Held by (module, name) rather than by parameter object: FSDP2 replaces the parameters it
    shards, and the slot always holds the current one.
    """

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.slots: list[tuple[nn.Module, str]] = []

    def local_grads(self) -> list[torch.Tensor]:
        grads = []
        for module, name in self.slots:
            grad = module._parameters[name].grad
            if grad is not None:
                grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
        return grads


@torch.no_grad()
def sum_tp_partial_grads(partials: list[TPPartialGrads]) -> int:
    """Sum the partial gradients listed in ``partials`` (one per model part) over TP: one all-reduce
    per (group, dtype). Call once per optimizer step, after the last backward and before clipping.
    Returns the number of all-reduces issued (0 without TP).
    """
    import torch.distributed as dist

    from xorl._torch_compat import flatten_dense_tensors as _flatten_dense_tensors
    from xorl._torch_compat import unflatten_dense_tensors as _unflatten_dense_tensors

    buckets: dict = {}
    for partial in partials:
        if partial is None or partial.tp.size == 1:
            continue
        for grad in partial.local_grads():
            key = (partial.tp.group, grad.device, grad.dtype)
            buckets.setdefault(key, []).append(grad)
    for (group, _, _), grads in buckets.items():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)
    return len(buckets)


class TPReplicated:
    """Mixin of a module whose own parameters are ``Replicate()`` DTensors on the TP mesh: its forward
    computes with their local tensors.

    ``replicate_on_tp`` gives the module the class ``TPReplicated<its class>`` (built once per class),
    as FSDP2's ``fully_shard`` gives a module the class ``FSDP<its class>``: the module's own
    ``forward`` and parameter names stay as they are, and nothing is set on the instance. Each
    DTensor slot holds its local tensor (differentiable back to the DTensor) for the duration of
    the call. The slot is read at call time, so FSDP2 swapping its unsharded parameter in before
    forward is respected; the DTensors are put back also when forward raises.
    """

    def forward(self, *args, **kwargs):
        saved = {name: param for name, param in self._parameters.items() if isinstance(param, DTensor)}
        for name, param in saved.items():
            self._parameters[name] = param.to_local()
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(saved)


@functools.cache
def _replicated_class(cls: type) -> type:
    return type(f"TPReplicated{cls.__name__}", (TPReplicated, cls), {"__module__": cls.__module__})


def replicate_on_tp(module: nn.Module, tp_mesh, memo: dict[int, nn.Parameter],
                    partial_grads: TPPartialGrads | None = None) -> list[str]:
    """Make ``module``'s own parameters Replicate DTensors on ``tp_mesh``; returns their names.

    ``memo`` maps id(old parameter) -> new DTensor parameter, so a parameter shared by two modules
    (tied embedding / lm_head) stays one parameter. ``partial_grads``: list the parameters there
    (their per-rank gradient is a partial sum; see the module docstring). The module then computes
    with the local tensors (``TPReplicated``).
    """
    if isinstance(module, TPReplicated):
        raise ValueError(f"{type(module).__name__} is already prepared for tensor parallel")
    names = []
    for name, param in list(module._parameters.items()):
        if param is None:
            continue
        if isinstance(param, DTensor):
            raise ValueError(
                f"{type(module).__name__}.{name} is already a DTensor ({param.placements}); "
                "apply_tensor_parallel must run before other plans that shard parameters"
            )
        module._parameters[name] = replicated_param(param, tp_mesh, memo)
        names.append(name)
        if partial_grads is not None:
            partial_grads.slots.append((module, name))
    if names:
        module.__class__ = _replicated_class(type(module))
    return names
