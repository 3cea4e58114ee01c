"""What a non-finite loss or gradient norm tells the user: whose fault it is, and what is left.

At the first step of a fresh run nothing has been updated yet, so the loss depends only on the
initial weights and the first batch. The weights are then checked, at the failure only (never in
a healthy step): every rank fills its own shards again (the optimizer step that followed the NaN
has already spread it to every parameter), looks for NaN / inf and the ranks agree on the first
such parameter. That re-reads this rank's shards of the model once, which only a failing run pays.

Later steps name the last complete checkpoint, or say that none was saved.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xorl.checkpoint.state import latest_checkpoint


def explain_nonfinite(trainer, error: Exception, initialise) -> str:
    """The message for ``error`` (a NonFiniteLossError raised by ``trainer.train_step``); collective at
    the first step of a fresh run (every rank fails at the same step: the loss and norm are global).
    ``initialise(part, config)`` fills a part's shards with the initial weights (xorl/trainer/trainer.py's)."""
    config = trainer.config
    what = str(error)  # "step N: loss=... grad_norm=..."
    if trainer.step == 0 and trainer.setup.resume is None:
        bad = first_nonfinite_parameters(trainer.parts, config, initialise)
        source = (f"model.model_path={config.model.model_path!r}" if config.model.model_path
                  else f"the seeded initialisation (train.seed={config.train.seed}, "
                       f"model.initializer_range={config.model.initializer_range})")
        if bad:
            more = f" (and {len(bad) - 1} more parameters)" if len(bad) > 1 else ""
            return (f"{what}: not finite at the first step, before any update: the initial weights are at fault. "
                    f"{bad[0]} holds NaN or inf values{more}, as read from {source}; repair or replace those "
                    "weights. No checkpoint was saved")
        return (f"{what}: not finite at the first step, before any update, with every initial weight finite "
                f"(from {source}): the first batch of data.dataset={config.data.dataset!r} or the numerics "
                f"(train.dtype={config.train.dtype!r}) are at fault. No checkpoint was saved")
    trainer.checkpointer.wait()
    last = latest_checkpoint(config.train.output_dir)
    kept = (f"the last complete checkpoint is {last}: resume from it (--train.resume=true), e.g. with a "
            "lower train.lr or train.max_grad_norm" if last else
            "no checkpoint was saved before it (train.save_steps=" f"{config.train.save_steps})")
    return f"{what}: the training diverged; stopping, {kept}"


@torch.no_grad()
def first_nonfinite_parameters(parts, config, initialise) -> list[str]:
    """Names of the parameters whose initial values hold NaN or inf, in the model's order, over all ranks."""
    from xorl.distributed.shard_box import local_tensor

    bad: list[tuple[int, int, str]] = []
    for part in parts:
        initialise(part, config)
        for index, (name, param) in enumerate(part.named_parameters()):
            if not torch.isfinite(local_tensor(param)).all():
                bad.append((_order(name), index, name))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bad)
        bad = [item for rank_bad in gathered for item in rank_bad]
    names: list[str] = []
    for *_, name in sorted(set(bad)):  # the same parameter is found by each rank holding a shard of it
        if name not in names:
            names.append(name)
    return names


def _order(name: str) -> int:
    """Embedding first, then the layers by index, then the rest: "first" as a reader of the model means it."""
    if "embed" in name:
        return -1
    parts = name.split(".")
    for i, piece in enumerate(parts[:-1]):
        if piece == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return 1 << 30
