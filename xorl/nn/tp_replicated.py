"""Replicated parameters of a tensor-parallel model: DTensors outside, local tensors inside forward.

Why DTensors at all: after TP every other parameter is a DTensor on the TP mesh; FSDP2 then
shards all of them on the dp mesh into one 2-D (dp, tp) layout, and torch's clip_grad_norm_ /
foreach optimizers need every parameter on the same mesh. So the parameters TP does not shard
(norms, embeddings, lm_head, q/k norms) become ``Replicate()`` DTensors on the TP mesh.

Why local tensors inside forward: the modules that own them (RMSNorm, nn.Embedding, ...) compute
with plain activations, and DTensor refuses to mix the two. ``replicate_on_tp`` wraps the
module's forward so that, for the duration of the call, each parameter slot holds the local
tensor ``param.to_local()`` (differentiable back to the DTensor parameter), then puts the
parameter back, also when forward raises. The slot is read at call time, so FSDP2 swapping its
unsharded parameter in before forward is respected.

``sum_grads=True`` is for parameters whose per-rank use sees only part of the data: RMSNorm on
a sequence shard (sequence parallel), q/k norms on this rank's heads. Their gradient is then
summed over the TP ranks in backward, so every rank holds the full (identical) gradient.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from xorl.nn.tp_comm import TPGroup
from xorl.nn.tp_regions import sum_grad_over_tp

_WRAPPED_FLAG = "_xorl_tp_replicated"


def replicate_on_tp(module: nn.Module, tp_mesh, tp: TPGroup, sum_grads: bool,
                    memo: dict[int, nn.Parameter] | None = None) -> list[str]:
    """Make ``module``'s own parameters Replicate DTensors on ``tp_mesh``; returns their names.

    ``memo`` maps id(old parameter) -> new DTensor parameter, so a parameter shared by two modules
    (tied embedding / lm_head) stays one parameter.
    """
    if getattr(module, _WRAPPED_FLAG, False):
        raise ValueError(f"{type(module).__name__} is already prepared for tensor parallel")
    memo = {} if memo is None else memo
    names = []
    for name, param in list(module._parameters.items()):
        if param is None:
            continue
        if isinstance(param, DTensor):
            raise ValueError(
                f"{type(module).__name__}.{name} is already a DTensor ({param.placements}); "
                "apply_tensor_parallel must run before other plans that shard parameters"
            )
        new = memo.get(id(param))
        if new is None:
            local = param.detach()
            new = nn.Parameter(DTensor.from_local(local, tp_mesh, [Replicate()], run_check=False),
                               requires_grad=param.requires_grad)
            memo[id(param)] = new
        module._parameters[name] = new
        names.append(name)
    if not names:
        return names
    inner_forward = module.forward

    @functools.wraps(inner_forward)
    def forward(*args, **kwargs):
        saved = {}
        for name in names:
            param = module._parameters[name]
            if isinstance(param, DTensor):
                local = param.to_local()
                saved[name] = param
                module._parameters[name] = sum_grad_over_tp(local, tp) if sum_grads else local
        try:
            return inner_forward(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward
    setattr(module, _WRAPPED_FLAG, True)
    module._xorl_tp_sum_grads = bool(sum_grads)
    return names


def is_replicated_on_tp(module: nn.Module) -> bool:
    return bool(getattr(module, _WRAPPED_FLAG, False))
