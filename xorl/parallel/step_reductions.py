"""What a step reduces besides what FSDP2 reduces itself: the DDP gradient sum and the routers' loads.

Called every step by ``StepPlan`` (xorl/parallel/step_plan.py): ``all_reduce_gradients`` after the
last backward (data_parallel_mode: ddp), ``step_router_loads`` after the optimizer step (MoE).

Gradients are SUMMED across data-parallel ranks (FSDP's divide factor 1, DDP's all-reduce sum):
the loss is already normalised by the global token count (xorl/trainer/loss.py), so averaging
again would scale gradients by 1/dp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xorl.nn.moe import MoE


@torch.no_grad()
def all_reduce_gradients(params, group, bucket_bytes: int = 64 * 2**20) -> None:
    """data_parallel_mode ddp: replicas sum their gradients (same normalisation as FSDP above).

    Why buckets: one all-reduce per parameter would be hundreds of small collectives per step (723
    for a 70B model); gradients are flattened into buckets of up to ``bucket_bytes`` per dtype, one
    all-reduce each, and copied back.
    """
    import torch.distributed as dist

    from xorl._torch_compat import flatten_dense_tensors as _flatten_dense_tensors
    from xorl._torch_compat import unflatten_dense_tensors as _unflatten_dense_tensors

    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for i, grad in enumerate(grads):
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= bucket_bytes or i == len(grads) - 1:
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    g.copy_(reduced)
                bucket, size = [], 0


@torch.no_grad()
def step_router_loads(models, group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None,
                      device: torch.device | None = None) -> torch.Tensor | None:
    """After an optimizer step, from the tokens each router sent to each expert in the step's
    training forwards, summed over ``group`` (the data x context x tensor ranks: every token of the
    step once) in one all-reduce for all routers:

    * auxiliary-loss-free balancing: every router with an expert bias moves it by that load;
    * returns the step's expert load metric, a device scalar: max over the MoE layers (and over the
      pipeline stages, ``pp_group``) of the busiest expert's tokens / the mean expert's (1.0: even;
      num_experts / top_k: every token on the same experts). None without MoE layers anywhere.
    Every router's count starts again at zero. ``device``: where a stage without routers puts its 0."""
    routers = [m.gate for model in models for m in model.modules() if isinstance(m, MoE)]
    worst = torch.zeros((), dtype=torch.float64, device=device)
    if routers:
        loads = torch.stack([r.pending_load() for r in routers])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
        for router, load in zip(routers, loads):
            router.apply_load(load)  # resets the count; moves the bias where there is one
        loads = loads.double()
        worst = (loads.amax(dim=1) / loads.mean(dim=1).clamp(min=1e-30)).amax()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        # Stages without MoE layers (a dense first stage) report 0; the pipeline's worst layer wins.
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp_group)
    elif not routers:
        return None
    return worst
