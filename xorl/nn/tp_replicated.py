"""Parameters a module keeps on every TP rank, or splits with its heads, while its forward stays its own.

``replicate_on_tp``: the parameters TP does not shard (norms, the MLA latents' projections, a
vocabulary that does not divide) become ``Replicate()`` DTensors on the TP mesh, because FSDP2 then
shards every parameter on the dp mesh into one 2-D (dp, tp) layout and clip-grad / foreach
optimizers need them on one mesh. ``split_with_heads``: a module's own per-head parameters
(gpt-oss's attention sinks, one logit per query head) become ``Shard(0)`` DTensors, this rank's
contiguous block of heads, as the column layers split the projections. Either way the module
computes with the local tensors (``param.to_local()``, differentiable back to the DTensor), swapped
into its parameter slots for the duration of the call (the class ``TPLocalTensors<its class>`` that
``put_params_on_tp`` gives it, as FSDP2 gives its own). Where a rank's use sees only part of the data
(RMSNorm on a sequence shard, q/k norms on this rank's heads) each rank's gradient is a partial sum:
those parameters are listed in a ``TPPartialGrads`` and ``sum_tp_partial_grads`` adds them up over TP
once per optimizer step, in one flattened all-reduce (instead of one per parameter per microbatch).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

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


class TPLocalTensors:
    """Mixin of a module whose own parameters are DTensors on the TP mesh (replicated, or split with
    its heads): its forward computes with their local tensors.

    ``put_params_on_tp`` gives the module the class ``TPLocalTensors<its class>`` (built once per class),
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
def _local_tensors_class(cls: type) -> type:
    return type(f"TPLocalTensors{cls.__name__}", (TPLocalTensors, cls), {"__module__": cls.__module__})


def put_params_on_tp(module: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """The one place TP changes a module's own parameters from outside: ``params`` (DTensors on the TP
    mesh) take the module's parameter slots of the same names, and the module gets the class
    ``TPLocalTensors<its class>`` (its forward computes with the local tensors). Names and values
    stay; only the placement is new."""
    _check_not_placed(module)
    unknown = sorted(set(params) - set(_own_params(module)))
    if unknown:
        raise ValueError(f"{type(module).__name__} has no parameters {unknown} to put on the TP mesh")
    for name, param in params.items():
        module._parameters[name] = param
    if params:
        module.__class__ = _local_tensors_class(type(module))


def _own_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {name: param for name, param in module._parameters.items() if param is not None}


def _check_not_placed(module: nn.Module) -> None:
    if isinstance(module, TPLocalTensors):
        raise ValueError(f"{type(module).__name__} is already prepared for tensor parallel")
    for name, param in _own_params(module).items():
        if isinstance(param, DTensor):
            raise ValueError(
                f"{type(module).__name__}.{name} is already a DTensor ({param.placements}); "
                "apply_tensor_parallel must run before other plans that shard parameters"
            )


def replicate_on_tp(module: nn.Module, tp_mesh, memo: dict[int, nn.Parameter],
                    partial_grads: TPPartialGrads | None = None) -> list[str]:
    """Make ``module``'s own parameters Replicate DTensors on ``tp_mesh``; returns their names.

    ``memo`` maps id(old parameter) -> new DTensor parameter, so a parameter shared by two modules
    (tied embedding / lm_head) stays one parameter. ``partial_grads``: list the parameters there
    (their per-rank gradient is a partial sum; see the module docstring). The module then computes
    with the local tensors (``put_params_on_tp``).
    """
    _check_not_placed(module)
    own = _own_params(module)
    put_params_on_tp(module, {name: replicated_param(param, tp_mesh, memo) for name, param in own.items()})
    if partial_grads is not None:
        partial_grads.slots += [(module, name) for name in own]
    return list(own)


def split_with_heads(module: nn.Module, tp_mesh) -> list[str]:
    """Split ``module``'s own parameters [heads, ...] (gpt-oss's sinks) into contiguous blocks of heads,
    ``Shard(0)`` DTensors on ``tp_mesh`` holding this rank's block (the heads its column-parallel
    projections compute); returns their names. Every rank must hold the same full values."""
    tp_size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    _check_not_placed(module)
    own = _own_params(module)
    for name, param in own.items():
        if param.shape[0] % tp_size:
            raise ValueError(f"{type(module).__name__}.{name}: {param.shape[0]} heads are not divisible by "
                             f"tensor_parallel_size={tp_size}")
    put_params_on_tp(module, {
        name: nn.Parameter(DTensor.from_local(param.detach().chunk(tp_size)[rank].clone(), tp_mesh, [Shard(0)],
                                              run_check=False), requires_grad=param.requires_grad)
        for name, param in own.items()})
    return list(own)
