"""AdamW with linear warmup then cosine decay to ``min_lr_ratio × lr``."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based). A warmup longer than the run is
    cut to ``max_steps`` (the last step reaches the peak; prepare_run says so), so a smoke run with a
    small ``--train.max_steps`` needs no ``--train.warmup_steps`` as well."""
    warmup_steps = min(warmup_steps, max_steps)
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _mesh_key(p: torch.Tensor):
    return p.device_mesh if isinstance(p, DTensor) else None


def param_groups(params, weight_decay: float) -> list[dict]:
    """Parameter groups split by (DTensor mesh, decay): each group is one foreach kernel chain.

    Why split by mesh: foreach ops on DTensors need every tensor of a call on the same mesh (TP
    shards, EP experts and FSDP shards each have their own), and torch runs foreach per group.
    No weight decay on norms and biases (1-D tensors), the usual choice for transformers.
    """
    groups: dict = {}
    for p in params:
        if not p.requires_grad:
            continue
        decay = weight_decay if p.ndim >= 2 else 0.0
        key = (_mesh_key(p), decay)
        groups.setdefault(key, {"params": [], "weight_decay": decay})["params"].append(p)
    return list(groups.values())


def build_optimizer(params, train_config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(
        param_groups(params, train_config.weight_decay),
        lr=train_config.lr,
        betas=tuple(train_config.adam_betas),
        eps=train_config.adam_eps,
        # foreach: a few multi-tensor kernels per group instead of ~10 small ops per parameter.
        foreach=True,
    )
    tc = train_config
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    )
    return optimizer, scheduler


def set_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule (and every group's lr) where it is after ``step`` optimizer steps."""
    groups = scheduler.optimizer.param_groups
    scheduler.last_epoch = step
    # A loaded optimizer carries the checkpoint's base lr in each group ("initial_lr").
    scheduler.base_lrs = [group.get("initial_lr", base) for group, base in zip(groups, scheduler.base_lrs, strict=True)]
    for group, base_lr, lr_lambda in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base_lr * lr_lambda(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
