"""The train section's rules: optimiser and schedule numbers, checkpointing and the run folder,
torch.compile, export_hf, and the training loop's schedule, length, log sinks and profiler.

export_hf writes a transformers config, which has no sigmoid router and no shared expert: such
models are refused up front rather than after training (the DCP checkpoints keep their weights)."""

from __future__ import annotations

import math
import os
from typing import Any

from xorl.config.rules.common import at_least
from xorl.distributed.parallel_config import PIPELINE_SCHEDULES

# Zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble) split each block's backward into an
# input pass and a later weight pass. Under torch 2.11 (the GPU image's) that weight pass crashes on
# xorl's custom ops ('_input_metadata' is invalid: their backward nodes are freed in between) and,
# patched past that, trains 1.9e-5 off one process where 2.13 matches to 1e-10 (2.13 guards a
# double-counted gradient there). Read from the package metadata: the rules do not import torch.
SPLIT_BACKWARD_TORCH = (2, 13)


def installed_torch_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "0"


def installed_torch() -> tuple[int, int]:
    """(major, minor) of the installed torch, from its package metadata."""
    parts = installed_torch_text().split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in (parts + ["0", "0"])[:2])


def train_problems(t: Any) -> list[str]:
    problems = at_least("train", t, 0, "warmup_steps", "save_steps")
    problems += at_least("train", t, 1, "max_steps", "log_steps")
    not_finite = [name for name in ("lr", "min_lr_ratio", "weight_decay", "adam_eps", "max_grad_norm",
                                    "collective_timeout_s", "heartbeat_s") if not math.isfinite(getattr(t, name))]
    not_finite += ["adam_betas"] if not all(math.isfinite(b) for b in t.adam_betas) else []
    problems += [f"train.{name}={getattr(t, name)!r} must be a finite number" for name in not_finite]
    if not t.lr > 0:
        problems.append(f"train.lr={t.lr} must be > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(
            f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1] (final lr = min_lr_ratio x lr)"
        )
    if not t.weight_decay >= 0:
        problems.append(f"train.weight_decay={t.weight_decay} must be >= 0")
    if not all(0 <= b < 1 for b in t.adam_betas):
        problems.append(f"train.adam_betas={list(t.adam_betas)} must each be in [0, 1)")
    if not t.adam_eps > 0:
        problems.append(f"train.adam_eps={t.adam_eps} must be > 0")
    if not t.max_grad_norm >= 0:
        problems.append(f"train.max_grad_norm={t.max_grad_norm} must be >= 0 (0 disables clipping)")
    if t.activation_checkpointing_every_n_layers < 1:
        problems.append(
            f"train.activation_checkpointing_every_n_layers={t.activation_checkpointing_every_n_layers} "
            "must be >= 1 (1: every decoder block)"
        )
    elif t.activation_checkpointing_every_n_layers > 1 and t.activation_checkpointing in ("selective", "none", False):
        problems.append(
            f"train.activation_checkpointing_every_n_layers={t.activation_checkpointing_every_n_layers} applies to "
            f"activation_checkpointing: full, not {t.activation_checkpointing!r}; set activation_checkpointing: full "
            "or activation_checkpointing_every_n_layers: 1"
        )
    if getattr(t, "selective_checkpoint", "matmuls") != "matmuls" and t.activation_checkpointing != "selective":
        problems.append(
            f"train.selective_checkpoint={t.selective_checkpoint!r} applies to activation_checkpointing: "
            f"selective, not {t.activation_checkpointing!r}; set activation_checkpointing: selective or "
            "selective_checkpoint: matmuls"
        )
    if t.fsdp_reshard_after_forward == "always" and t.pipeline_parallel_size > 1 and \
            getattr(PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule), "split_backward", False):
        problems.append(
            "train.fsdp_reshard_after_forward: always with pipeline_parallel_schedule: "
            f"{t.pipeline_parallel_schedule}: "
            "zero-bubble schedules run each microbatch's weight gradients in a later pass that needs the stage's "
            "parameters still gathered; use fsdp_reshard_after_forward: default (or never), or the 1F1B / "
            "Interleaved1F1B schedule"
        )
    if t.pipeline_parallel_size > 1 and \
            getattr(PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule), "split_backward", False) and \
            installed_torch() < SPLIT_BACKWARD_TORCH:
        problems.append(
            f"train.pipeline_parallel_schedule: {t.pipeline_parallel_schedule} with torch {installed_torch_text()}: "
            "its zero-bubble weight pass frees the backward nodes of xorl's custom ops after the input pass "
            "(and hands the loss a copy of its gradient), verified to train like one process from torch "
            f"{'.'.join(map(str, SPLIT_BACKWARD_TORCH))}; use 1F1B or Interleaved1F1B, or a newer torch"
        )
    if t.fsdp_reshard_after_forward != "default" and t.data_parallel_mode != "fsdp2":
        problems.append(
            f"train.fsdp_reshard_after_forward={t.fsdp_reshard_after_forward!r} needs data_parallel_mode: fsdp2 "
            f"(it is {t.data_parallel_mode!r}); remove the setting or use fsdp2"
        )
    problems += _pipeline_grad_sync_problems(t)
    if not t.collective_timeout_s > 0:
        problems.append(f"train.collective_timeout_s={t.collective_timeout_s} must be > 0 (seconds)")
    if not t.heartbeat_s >= 0:
        problems.append(f"train.heartbeat_s={t.heartbeat_s} must be >= 0 (0: no heartbeat lines)")
    if not t.preempt_grace_s > 0:
        problems.append(f"train.preempt_grace_s={t.preempt_grace_s} must be > 0 (seconds from a preemption "
                        "signal to the exit)")
    if isinstance(t.resume, str) and not os.path.exists(t.resume):
        problems.append(
            f"train.resume={t.resume!r}: no such checkpoint; use true (latest in output_dir) or false"
        )
    problems += _output_dir_problems(t.output_dir)
    return problems


def _pipeline_grad_sync_problems(t: Any) -> list[str]:
    """pipeline_grad_sync chooses when an FSDP2 pipeline stage reduce-scatters: set elsewhere it would do
    nothing, so it is refused rather than ignored (the default passes everywhere)."""
    setting = getattr(t, "pipeline_grad_sync", "default")
    if setting == "default":
        return []
    if t.pipeline_parallel_size == 1:
        return [f"train.pipeline_grad_sync: {setting} applies to pipeline stages, and pipeline_parallel_size is 1 "
                "(there each FSDP2 block reduce-scatters after every microbatch's backward); remove "
                "pipeline_grad_sync or set pipeline_parallel_size > 1"]
    if t.data_parallel_mode != "fsdp2":
        return [f"train.pipeline_grad_sync: {setting} applies to data_parallel_mode: fsdp2 (it is "
                f"{t.data_parallel_mode!r}, which sums gradients once per step); remove pipeline_grad_sync "
                "or use fsdp2"]
    schedule = PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule)
    if setting == "per_microbatch" and getattr(schedule, "split_backward", False):
        return [f"train.pipeline_grad_sync: per_microbatch with pipeline_parallel_schedule: "
                f"{t.pipeline_parallel_schedule}: zero-bubble schedules run each microbatch's weight gradients in "
                "a later pass that needs the stage's parameters still gathered, so they reduce once per step; "
                "use pipeline_grad_sync: per_step (or default), or the 1F1B / Interleaved1F1B / GPipe schedule"]
    return []


def _output_dir_problems(output_dir: str) -> list[str]:
    """output_dir must be a folder this process can write, or creatable inside one."""
    if not output_dir:
        return ["train.output_dir is empty; name a folder for checkpoints and metrics"]
    path = os.path.abspath(output_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing == path and not os.path.isdir(path):
        return [f"train.output_dir={output_dir!r} is a file, not a folder; choose a folder"]
    if not os.path.isdir(existing):
        return [f"train.output_dir={output_dir!r} cannot be created: {existing!r} is a file"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"train.output_dir={output_dir!r}: {existing!r} is not writable; choose a folder you can write"]
    return []


def training_loop_problems(t: Any, d: Any, local: bool = True) -> list[str]:
    """lr_schedule and its knobs, num_epochs, the W&B / TensorBoard sinks and the profiler.

    A knob the chosen schedule does not use is refused when it differs from its default (never
    silently ignored); the default itself passes, so the run folder's config.yaml loads back."""
    from xorl.observability.sinks import missing_logging_packages

    problems, default = [], type(t)()  # TrainConfig's defaults (xorl.config imports this module)
    if t.lr_schedule == "constant" and t.min_lr_ratio != default.min_lr_ratio:
        problems.append(f"train.min_lr_ratio={t.min_lr_ratio} has no effect with lr_schedule: constant (no decay); "
                        "remove it, or choose lr_schedule: cosine, linear or wsd")
    if not (math.isfinite(t.decay_fraction) and 0 < t.decay_fraction <= 1):
        problems.append(f"train.decay_fraction={t.decay_fraction} must be in (0, 1] (the fraction of max_steps, "
                        "at the end, that lr_schedule: wsd decays over)")
    elif t.lr_schedule != "wsd" and t.decay_fraction != default.decay_fraction:
        problems.append(f"train.decay_fraction={t.decay_fraction} applies to lr_schedule: wsd, not "
                        f"{t.lr_schedule}; set lr_schedule: wsd or remove decay_fraction")
    if t.num_epochs is not None:
        if not (math.isfinite(t.num_epochs) and t.num_epochs > 0):
            problems.append(f"train.num_epochs={t.num_epochs} must be a number > 0 (passes over the data)")
        if d.streaming:
            problems.append("train.num_epochs needs the data's length, and data.streaming reads the files as "
                            "training goes without counting them first; set train.max_steps instead, or "
                            "data.streaming: false")
    for name in ("wandb_run_name", "wandb_mode"):
        if getattr(t, name) is not None and t.wandb_project is None:
            problems.append(f"train.{name}={getattr(t, name)!r} has no effect without train.wandb_project; set "
                            f"wandb_project (the W&B project to log to) or remove {name}")
    problems += missing_logging_packages(t) if local else []  # this machine's packages (validate_config)
    steps = t.profile_steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        problems.append(f"train.profile_steps={steps} must be [start, end] with 1 <= start <= end (1-based steps, "
                        "as on the console), or [] for no profiling")
    elif steps and t.num_epochs is None and steps[1] > t.max_steps:
        problems.append(f"train.profile_steps={steps} ends after train.max_steps={t.max_steps}; end at "
                        f"{t.max_steps} or earlier")
    snapshot = t.memory_snapshot_step
    if snapshot is not None and (snapshot < 1 or (t.num_epochs is None and snapshot > t.max_steps)):
        problems.append(f"train.memory_snapshot_step={snapshot} must be a step from 1 to train.max_steps"
                        f"{'' if t.num_epochs is not None else f'={t.max_steps}'} (1-based, as on the console)")
    return problems


def compile_problems(t: Any, m: Any) -> list[str]:
    """The layouts whose code torch.compile cannot trace as one graph per block, refused before they
    fail mid-run (each decoder block is compiled with fullgraph=True: xorl/parallel/compile.py)."""
    if not t.compile:
        return []
    # Tensor parallelism compiles: its linears and region collectives are torch.library custom ops
    # (xorl/nn/tp_linear_ops.py, tp_regions.py), one node each in a block's graph, with or without
    # activation checkpointing; the ring overlap's point-to-point runs inside them
    # (tests/multirank/test_compile_layouts.py: one graph per block kind, no break, the losses of eager).
    problems = []
    if m.num_experts and t.data_parallel_mode == "fsdp2" and \
            (t.expert_parallel_size > 1 or t.tensor_parallel_size > 1):
        # xorl/parallel/data_parallel.py experts_have_own_mesh: the experts' FSDP unit sits inside the block.
        problems.append(
            f"train.compile with an MoE model (model.num_experts={m.num_experts}) under expert_parallel_size="
            f"{t.expert_parallel_size}, tensor_parallel_size={t.tensor_parallel_size}: each block's experts are "
            "then an FSDP unit of their own (sharded on the expert mesh) inside the block, whose FSDP hooks "
            "torch.compile cannot trace, so the block would compile in pieces around them (graph breaks) or, "
            "under activation checkpointing, run eager; use compile: false, or expert_parallel_size: 1 and "
            "tensor_parallel_size: 1 (data / context parallelism compile the MoE block whole)"
        )
    schedule = PIPELINE_SCHEDULES.get(t.pipeline_parallel_schedule)
    if t.pipeline_parallel_size > 1 and schedule is not None and schedule.split_backward:
        problems.append(
            f"train.compile with pipeline_parallel_schedule: {t.pipeline_parallel_schedule}: zero-bubble schedules "
            "split each block's backward into an input pass and a later weight pass, but a compiled block has one "
            "fused backward (which frees its buffers after the first pass); use 1F1B, Interleaved1F1B or GPipe, "
            "or compile: false"
        )
    if m.attn_implementation == "flash_attn" and t.ringattn_parallel_size * t.ulysses_parallel_size == 1:
        problems.append(
            "train.compile with model.attn_implementation: flash_attn (no context parallelism): the flash-attn "
            "package's functions trace only in the versions that register them as torch custom ops, and xorl has "
            "not verified any under compile; use attn_implementation: xorl (or sdpa), or compile: false"
        )
    return problems


def export_problems(m: Any, t: Any) -> list[str]:
    if not t.export_hf:
        return []
    if m.model_type != "qwen3_moe":  # whatever the family's transformers class cannot hold
        from xorl.models.registry import to_hf_config_dict

        try:
            to_hf_config_dict(m)
        except ValueError as e:
            return [f"train.export_hf=true: {e}; set export_hf: false (the checkpoints keep the weights)"]
        return []
    problems = []
    if m.router_scoring != "softmax":
        problems.append(
            f"train.export_hf=true with model.router_scoring={m.router_scoring!r}: transformers' "
            "Qwen3MoeForCausalLM routes with softmax only, so the export could not be loaded as this model; "
            "set export_hf: false (the checkpoints keep the weights) or router_scoring: softmax"
        )
    if m.shared_expert_intermediate_size:
        problems.append(
            f"train.export_hf=true with model.shared_expert_intermediate_size="
            f"{m.shared_expert_intermediate_size}: transformers' Qwen3MoeForCausalLM has no shared expert; "
            "set export_hf: false (the checkpoints keep the weights) or shared_expert_intermediate_size: 0"
        )
    if m.router_expert_bias:
        problems.append(
            "train.export_hf=true with model.router_expert_bias=true: transformers' Qwen3MoeForCausalLM has no "
            "expert selection bias, so the export would route differently; set export_hf: false or "
            "router_expert_bias: false"
        )
    return problems
