"""prepare_run: everything checked before any process group starts, and the set-up the trainer follows (RunSetup).

Every rank (and the launcher script, for a one-message refusal) runs it; it only reads files, so
all ranks reach the same verdict. Problems are collected and raised together as one ConfigError:

- the config rules (xorl/config/validate.py) and the layouts this trainer cannot run yet;
- ``model.model_path``: its weights' headers fit the model (names and shapes);
- the run folder: a fresh run into a non-empty ``output_dir`` is refused unless
  ``overwrite_output_dir: true`` (which removes the earlier run's files first; files xorl did not
  write are never removed, so the run is refused instead);
- resuming: which checkpoint, whether it is complete (its manifest names a missing or short
  file), and whether the new config may resume it (xorl/run/resume.py). ``resume: true`` with no
  checkpoint starts from step 0 and says so; a finished run says there is nothing to train.

No torch import for the rules: a bad config is refused in a second, before torch loads (only a
valid config with a model_path loads torch, to build the model on the meta device; with num_epochs,
to pack the data and count it, xorl/trainer/epochs.py; with memory_snapshot_step, to see whether there is a GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import xorl.run.folder as run_dir
import xorl.run.lock as run_lock
from xorl.config.errors import ConfigError
from xorl.config.validate import validate_config
from xorl.distributed.parallel_config import ParallelConfig
from xorl.run.resume import check_resume
from xorl.run.watchdog import heartbeat_interval
from xorl.trainer.epochs import load_counted_dataset, resolve_num_epochs


@dataclass
class ResumePoint:
    path: str
    step: int
    consumed_sequences: int  # the data position: sequences of the global order already trained on
    elapsed_s: float  # training time up to the checkpoint (metrics' ``time`` continues from it)
    data_state: dict | None = None  # data.streaming: where the stream stands (xorl/data/stream.py)


@dataclass
class RunSetup:
    resume: ResumePoint | None = None
    overwrite: bool = False  # rank 0 removes the earlier run's files before writing anything
    apply_config_hparams: bool = False  # the new lr / schedule / AdamW values go over the loaded state
    finished: bool = False  # the checkpoint is at max_steps: nothing to train
    discard_later: bool = False  # rank 0 moves the checkpoints after ``resume`` aside (train.discard_later)
    notes: list[str] = field(default_factory=list)  # what the user should know; rank 0 prints them
    # The packed in-memory data (not data.streaming), read before start-up; the trainer trains on it (read once).
    dataset: Any = None
    eval_dataset: Any = None  # the eval set (train.eval_steps), read before start-up too; xorl/trainer/evaluate.py


def prepare_run(config: Any, world_size: int) -> RunSetup:
    """Check ``config`` on ``world_size`` ranks and its run folder; raise one ConfigError listing
    every problem, else return the set-up (``config`` may change: resume_hparams=checkpoint)."""
    # Another run in this folder: refuse, nothing else, and first: the rules below import the model
    # families (and torch, seconds to tens of seconds on a loaded node). Rank 0 looks (it is the one that
    # takes the lock, xorl/run/lock.py); another rank would take its own job's rank 0 of an earlier
    # start for a stranger.
    busy = run_lock.holder(config.train.output_dir) if os.environ.get("RANK", "0") == "0" else None
    if busy:
        raise ConfigError([busy])
    problems = []
    try:
        validate_config(config, world_size)
    except ConfigError as e:
        problems += e.problems
    setup = RunSetup()
    if (config.train.num_epochs is not None or not config.data.streaming) and not problems:
        # In-memory data is read here, before any process group: a bad row is one message up front (and
        # `--check` finds it), and num_epochs derives max_steps from its length; the trainer trains on it.
        try:
            setup.dataset = load_counted_dataset(config)
        except ConfigError as e:
            problems += e.problems
    if config.train.eval_steps and not problems:
        try:
            setup.eval_dataset = load_counted_dataset(config, part="eval")
        except ConfigError as e:
            problems += e.problems
    try:
        problems += _set_up_run_dir(config, world_size, setup)  # derives max_steps when it resumes
    except ConfigError as e:  # e.g. sizes that do not fit world_size, already listed above
        problems += [p for p in e.problems if p not in problems]
    if config.train.num_epochs is not None and setup.dataset is not None and setup.resume is None and not problems:
        problems += _resolve_epochs(config, world_size, setup)
    if config.train.warmup_steps > config.train.max_steps:  # xorl/trainer/optim.py's lr_factor cuts it
        setup.notes.append(f"train.warmup_steps={config.train.warmup_steps} is more than train.max_steps="
                          f"{config.train.max_steps}: warming up over {config.train.max_steps} steps")
    beat = heartbeat_interval(config.train.heartbeat_s, config.train.collective_timeout_s)
    if beat != config.train.heartbeat_s:
        setup.notes.append(f"train.heartbeat_s={config.train.heartbeat_s:g} is not below train.collective_timeout_s="
                          f"{config.train.collective_timeout_s:g}: heartbeat lines every {beat:g} s instead, so a "
                          "stalled rank shows before the timeout ends the job")
    if config.train.memory_snapshot_step is not None and not problems:
        from xorl.observability.profiling import memory_snapshot_problems

        problems += memory_snapshot_problems(config.train)
    if not problems:  # the weights' headers, once the model section itself is valid
        from xorl.config.model_path import model_path_weight_problems

        problems += model_path_weight_problems(config)
    if problems:
        raise ConfigError(problems)
    return setup


def _set_up_run_dir(config: Any, world_size: int, setup: RunSetup) -> list[str]:
    t = config.train
    out = t.output_dir
    found = run_dir.entries(out)
    if not t.resume:
        if found and not t.overwrite_output_dir:
            return [
                f"train.output_dir={out!r} already holds {_some(found)}: a fresh run would mix with it. "
                "Continue that run with --train.resume=true, replace it with --train.overwrite_output_dir=true, "
                "or choose another train.output_dir"
            ]
        return _set_up_overwrite(out, found, setup)
    checkpoint = t.resume if isinstance(t.resume, str) else run_dir.latest_checkpoint(out)
    inside = checkpoint is not None and run_dir.is_inside(checkpoint, out)
    if t.overwrite_output_dir and (t.resume is True or inside):
        return [
            f"train.overwrite_output_dir=true with train.resume={t.resume!r}: overwriting {out!r} would delete "
            "the checkpoint to resume; choose one of them"
        ]
    problems = []
    if isinstance(t.resume, str):
        if not os.path.exists(checkpoint):
            return []  # validate_config names it
        if not inside and found and not t.overwrite_output_dir:
            return [
                f"train.resume={checkpoint!r} is another folder's checkpoint, and train.output_dir={out!r} already "
                f"holds {_some(found)}; continue it into an empty output_dir, or add --train.overwrite_output_dir=true"
            ]
        if t.overwrite_output_dir:  # the checkpoint lies outside output_dir (refused above otherwise)
            problems += _set_up_overwrite(out, found, setup)
        later = [n for n in run_dir.step_folders(out) if inside and n > os.path.basename(os.path.normpath(checkpoint))]
        if later and t.discard_later:
            setup.discard_later = True
            setup.notes.append(f"train.discard_later=true: moving the later {_some(later)} aside into "
                              f"{os.path.join(run_dir.checkpoint_root(out), run_dir.DISCARDED_DIR)}/")
        elif later:
            return [
                f"train.resume={checkpoint!r}: {run_dir.checkpoint_root(out)} also holds the later {_some(later)} "
                "of the run that went on; resuming here would mix the two. Add --train.discard_later=true to move "
                f"them aside (into {os.path.join(run_dir.checkpoint_root(out), run_dir.DISCARDED_DIR)}/, deleting "
                "nothing), or continue into another train.output_dir"
            ]
    elif checkpoint is None:
        root = run_dir.checkpoint_root(out)
        steps = run_dir.step_folders(out)
        if steps:
            return [
                f"train.resume=true: {root} holds {_some(steps)} but no complete checkpoint named by "
                f"'{run_dir.LATEST}'; pass one with --train.resume=PATH"
            ]
        setup.notes.append(
            f"train.resume=true: no checkpoint in {root}; starting from step 0"
            + (f" (replacing {out}/{run_dir.METRICS_NAME})" if run_dir.METRICS_NAME in found else "")
        )
        return []
    problems += run_dir.checkpoint_problems(checkpoint)
    if problems:
        return problems
    try:
        stored, state = run_dir.read_checkpoint_files(checkpoint)
        step, consumed = int(state["step"]), int(state["consumed_sequences"])
        elapsed, old_batch = float(state["elapsed_s"]), int(state["global_batch"])
    except ConfigError as e:
        return e.problems
    except (KeyError, TypeError, ValueError) as e:
        return [f"checkpoint {checkpoint}: {run_dir.TRAINER_STATE_NAME} lacks or garbles {e}"]
    if config.train.num_epochs is not None and setup.dataset is not None:  # the steps the epochs still need
        problems += _resolve_epochs(config, world_size, setup, step, consumed)
        if problems:
            return problems
    problems, notes, setup.apply_config_hparams = check_resume(config, stored, checkpoint, step)
    problems += layout_problems(config.model, state, checkpoint)
    setup.notes += notes
    if problems:
        return problems
    setup.resume = ResumePoint(checkpoint, step, consumed, elapsed, state.get("data_state"))
    setup.notes.append(f"resuming {checkpoint} at step {step}, sequence {consumed} of the data")
    new_batch = global_batch(config, world_size)
    if new_batch != old_batch:
        setup.notes.append(
            f"the global batch changed from {old_batch} to {new_batch} sequences a step; the data continues at "
            f"sequence {consumed}, so every sequence is still seen once"
        )
    if step >= t.max_steps:
        setup.finished = True
        setup.notes.append(
            f"the run is finished: {checkpoint} is at step {step} and train.max_steps={t.max_steps}; nothing to "
            f"train. To train further, raise --train.{'max_steps' if t.num_epochs is None else 'num_epochs'} "
            "(with --train.resume_hparams=config, since it changes the schedule)"
        )
    return []


def _resolve_epochs(config: Any, world_size: int, setup: RunSetup, step: int = 0, consumed: int = 0) -> list[str]:
    try:
        setup.notes.append(resolve_num_epochs(config, setup.dataset, global_batch(config, world_size), step, consumed))
    except ConfigError as e:
        return e.problems
    return []


def _set_up_overwrite(out: str, found: list[str], setup: RunSetup) -> list[str]:
    if not found:
        return []
    foreign = [name for name in found if name not in run_dir.XORL_ENTRIES]
    if foreign:
        return [
            f"train.overwrite_output_dir=true but {out!r} also holds {_some(foreign)}, which xorl did not write; "
            "overwrite removes only xorl's files, so remove those yourself or choose another output_dir"
        ]
    setup.overwrite = True
    setup.notes.append(f"train.overwrite_output_dir=true: removing the earlier run's {_some(found)} from {out}")
    return []


_LAYOUT_FIX = ("resume it with the xorl that saved it, or export it there (xorl-export) and start a new run from "
               "the export with model.model_path")


def layout_problems(model_config: Any, state: dict, checkpoint: str, fix: str = _LAYOUT_FIX) -> list[str]:
    """Checkpoints of an older parameter layout: a merge_qkv one whose qkv_proj rows are in another
    order (same name and shape: loading it would mix heads without any error), and an MoE one with
    separate expert gate / up weights (it would fail only when DCP loads it, after start-up)."""
    from xorl.models.spec import EXPERTS_LAYOUT, QKV_LAYOUT

    problems = []
    if model_config.merge_qkv and state.get("qkv_layout") != QKV_LAYOUT:
        problems.append(f"checkpoint {checkpoint}: its self_attn.qkv_proj is in the older [q; k; v] row order, and "
                        f"this xorl groups the rows by KV head (qkv_layout {QKV_LAYOUT!r}); {fix}")
    if model_config.num_experts and state.get("experts_layout") != EXPERTS_LAYOUT:
        problems.append(f"checkpoint {checkpoint}: its MoE experts hold gate_proj and up_proj apart (an older "
                        f"xorl), and this xorl fuses them into experts.gate_up_proj (experts_layout "
                        f"{EXPERTS_LAYOUT!r}); {fix}")
    return problems


def global_batch(config: Any, world_size: int) -> int:
    """Sequences per optimizer step over all data-parallel ranks."""
    dp = ParallelConfig.from_config(config, world_size).dp
    return config.data.micro_batch_size * config.train.gradient_accumulation_steps * dp


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
