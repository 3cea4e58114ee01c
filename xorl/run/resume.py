"""Resuming a run: which settings may differ from the checkpoint's, and which value wins.

Each checkpoint stores the config it was trained with (run_config.yaml). On resume every field is
compared with the new config, in three kinds:

- HPARAM_FIELDS (lr, lr_schedule, min_lr_ratio, decay_fraction, warmup_steps, max_steps, num_epochs,
  weight_decay, adam_betas, adam_eps): the optimizer and schedule state carry or depend on them.
  A change is refused, listing each field old -> new, unless ``train.resume_hparams`` says which
  wins: ``checkpoint`` keeps the checkpoint's values (the config's are replaced before anything is
  built), ``config`` applies the new ones to the loaded param groups and schedule
  (``apply_config_hparams``).
- Fields that cannot change: the model's architecture (the weights have its shapes and meaning)
  and the data order (dataset, text_key, tokenizer, seq_len, packing, data.seed, streaming, format,
  train_on, split, eval_fraction), because the data position is counted in packed sequences of
  that order. Refused with the reason.
- Everything else (the parallel layout, micro batch, accumulation, clipping, logging, ...):
  the new value applies, and a note lists it. The data continues at the first sequence the
  checkpoint had not consumed, whatever the new global batch (xorl/data/loader.py).
"""

from __future__ import annotations

from typing import Any

HPARAM_FIELDS = ("lr", "lr_schedule", "min_lr_ratio", "decay_fraction", "warmup_steps", "max_steps", "num_epochs",
                 "weight_decay", "adam_betas", "adam_eps")
# Model fields a checkpoint does not depend on: kernels, where initial weights came from, loss knobs.
FREE_MODEL_FIELDS = ("attn_implementation", "model_path", "initializer_range", "router_aux_loss_coef",
                     "router_z_loss_coef", "fused_loss")
# (format, train_on, split and eval_fraction decide which rows train and how they pack: the order too)
DATA_ORDER_FIELDS = ("dataset", "text_key", "tokenizer", "seq_len", "packing", "seed", "streaming", "format",
                     "train_on", "split", "eval_fraction")
# How to resume, not what: never compared.
NOT_COMPARED = ("train.resume", "train.resume_hparams", "train.overwrite_output_dir", "train.output_dir",
                "train.discard_later")


def config_changes(stored: dict[str, Any], config: Any) -> list[tuple[str, Any, Any]]:
    """(section.key, checkpoint value, new value) for every field that differs."""
    changes = []
    for section, values in config.to_dict().items():
        old_values = stored.get(section) or {}
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in NOT_COMPARED and key in old_values and old_values[key] != value \
                    and not (name == "model.lora" and _same_adapter(old_values[key], value)):
                changes.append((name, old_values[key], value))
    return changes


def _same_adapter(old: Any, new: Any) -> bool:
    from xorl.nn.lora import adapter_identity

    return adapter_identity(old) == adapter_identity(new)


def _kind(name: str, old: Any = None, new: Any = None) -> str:
    if name == "model.lora":  # another dropout (or init, which the loaded weights replace) trains on
        from xorl.nn.lora import adapter_architecture

        return "applied" if adapter_architecture(old) == adapter_architecture(new) else "fixed"
    section, key = name.split(".")
    if section == "train" and key in HPARAM_FIELDS:
        return "hparam"
    if (section == "model" and key not in FREE_MODEL_FIELDS) or (section == "data" and key in DATA_ORDER_FIELDS):
        return "fixed"
    return "applied"


def _listing(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in changes)


def check_resume(config: Any, stored: dict[str, Any], checkpoint: str, step: int) -> tuple[list[str], list[str], bool]:
    """(problems, notes, whether the new hparams must be applied after loading). With
    ``resume_hparams: checkpoint`` the checkpoint's values are written into ``config`` here."""
    from xorl.config import TrainConfig
    from xorl.config.field_types import coerce
    from xorl.config.field_types import type_hints as _type_hints

    changes = config_changes(stored, config)
    by_kind: dict[str, list] = {"hparam": [], "fixed": [], "applied": []}
    for change in changes:
        by_kind[_kind(*change)].append(change)
    problems, notes = [], []
    for name, old, new in by_kind["fixed"]:
        why = ("the checkpoint's weights have that architecture; train another model in a new run "
               "(another output_dir), starting from an export with model.model_path"
               if name.startswith("model.") else
               "the data position is counted in sequences of the checkpoint's data order; start a new run "
               "(another output_dir) for other data")
        problems.append(f"cannot resume {checkpoint} with {name} {old!r} -> {new!r}: {why}")
    hparams = by_kind["hparam"]
    mode = config.train.resume_hparams
    if hparams and mode == "error":
        problems.append(
            f"train.resume: {checkpoint} was trained with other optimizer/schedule settings: {_listing(hparams)}. "
            f"Say which win: --train.resume_hparams=config applies the new values from step {step}, "
            "--train.resume_hparams=checkpoint keeps the checkpoint's"
        )
    elif hparams and mode == "checkpoint":
        hints = _type_hints(TrainConfig)
        for name, old, _ in hparams:
            key = name.split(".")[1]
            setattr(config.train, key, coerce(old, hints[key], name))
        notes.append("train.resume_hparams=checkpoint: keeping the checkpoint's "
                     + ", ".join(f"{name}={old!r} (the config said {new!r})" for name, old, new in hparams))
    elif hparams:
        notes.append(f"train.resume_hparams=config: from step {step} the new values apply: {_listing(hparams)}")
    if by_kind["applied"]:
        notes.append(f"changed since the checkpoint, applied as given: {_listing(by_kind['applied'])}")
    return problems, notes, bool(hparams) and mode == "config"


def apply_config_hparams(optimizers: list, schedulers: list, train: Any) -> None:
    """Put the config's lr, betas, eps, weight decay and schedule over what a checkpoint loaded.

    The values come from a freshly built optimizer (so the weight-decay grouping is build_optimizer's
    own); each schedule's lambdas read ``train`` (the same object), so only its base lr is reset.
    """
    from xorl.trainer.optim import build_optimizer

    for optimizer, scheduler in zip(optimizers, schedulers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        fresh, _ = build_optimizer(params, train)
        for group, new in zip(optimizer.param_groups, fresh.param_groups, strict=True):
            if {id(p) for p in group["params"]} != {id(p) for p in new["params"]}:
                raise RuntimeError("the loaded optimizer's param groups differ from build_optimizer's")
            for key in ("betas", "eps", "weight_decay"):
                group[key] = new[key]
            group["initial_lr"] = new["initial_lr"]  # the base lr (new["lr"] is already scheduled)
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
