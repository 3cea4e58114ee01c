"""AdamW with linear warmup then cosine decay to ``min_lr_ratio × lr``."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params, train_config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in params if p.requires_grad]
    # No weight decay on norms and biases (1-D tensors), the usual choice for transformers.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train_config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=train_config.lr,
        betas=tuple(train_config.adam_betas),
        eps=train_config.adam_eps,
        # foreach=False keeps DTensor params of different meshes (TP, EP, FSDP) in separate kernels.
        foreach=False,
    )
    tc = train_config
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    )
    return optimizer, scheduler
