"""AdamW and its learning-rate schedule: linear warmup, then cosine, linear, constant or WSD.

The schedule is a function of the optimizer step alone (``lr_factor``), run by torch's LambdaLR, so a
resumed run only sets the step (``set_schedule_step``) and every layout follows the same curve.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float, schedule: str = "cosine",
              decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based).

    Warmup: ``(step + 1) / warmup_steps`` for the first warmup_steps steps. A warmup longer than the
    run is cut to ``max_steps`` (the last step reaches the peak; prepare_run says so), so a smoke run
    with a small ``--train.max_steps`` needs no ``--train.warmup_steps`` as well. Then, with
    ``progress`` going from 0 at the first step after warmup (or of the decay, for wsd) towards 1 at
    ``max_steps`` (the step after the last, as torch's and Megatron's schedules count):

    - cosine: ``min + (1 - min) * (1 + cos(pi * progress)) / 2``;
    - linear: ``min + (1 - min) * (1 - progress)``;
    - constant: 1 (no decay; min_lr_ratio is not used);
    - wsd (warmup-stable-decay): 1 until the last ``round(decay_fraction * max_steps)`` steps (at least
      one, never into the warmup), then ``min + (1 - min) * (1 - sqrt(progress))`` over them: the
      "1-sqrt" cooldown, which Hägele et al. 2024 (arXiv:2405.18392) found to match cosine at the
      same length better than a linear one.
    """
    warmup_steps = min(warmup_steps, max_steps)
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_start = warmup_steps
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * max_steps))
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return 1.0
    progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "wsd":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; one of {LR_SCHEDULES}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


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


def adamw_implementation(groups: list[dict]) -> dict:
    """``{"fused": True}`` when every parameter is on CUDA, else ``{"foreach": True}``.

    Why: the fused kernel does the whole AdamW update of many tensors in one launch per group (no
    intermediate tensors), the fastest on a GPU; torch's fused AdamW needs every tensor on a GPU.
    On the CPU foreach (a few multi-tensor ops per group instead of ~10 small ops per parameter)
    stays the choice, as before.
    """
    devices = {p.device.type for group in groups for p in group["params"]}
    return {"fused": True} if devices == {"cuda"} else {"foreach": True}


def build_optimizer(params, train_config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    groups = param_groups(params, train_config.weight_decay)
    optimizer = torch.optim.AdamW(
        groups,
        lr=train_config.lr,
        betas=tuple(train_config.adam_betas),
        eps=train_config.adam_eps,
        **adamw_implementation(groups),
    )
    tc = train_config
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio, tc.lr_schedule,
                                          tc.decay_fraction)
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
