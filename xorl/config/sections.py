"""The run config's three sections, ``model:``, ``data:`` and ``train:``, as dataclasses: each field once,
with its default and (in the comment beside it) its meaning, which ``xorl-train --help`` prints.

``Config()`` is a tiny dense model valid for 1 process. Setting one field (``set_field``: its type
checked, an old spelling named, the closest valid name suggested) is here; reading YAML and CLI
overrides into a ``Config`` is xorl/config/load.py; the rules that tie fields together and to the world size are
xorl/config/validate.py. With ``model.model_path`` the folder's config.json defines the model
(xorl/config/model_path.py). ``Config.origins`` records where each explicitly set field came from.

Model field names are the Hugging Face config attribute names, so the models accept either a
``ModelConfig`` or a ``transformers`` config. ``head_dim: null`` means hidden_size // heads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from xorl.config.errors import ConfigError, did_you_mean
from xorl.config.field_types import accepts_str as _accepts_str
from xorl.config.field_types import coerce
from xorl.config.field_types import type_hints as _type_hints
from xorl.config.field_types import type_name as _type_name
from xorl.config.validate import validate_config
from xorl.distributed.parallel_config import ParallelFields
from xorl.models.schema import model_config_class

__all__ = ["Config", "DataConfig", "ModelConfig", "TrainConfig", "compute_dtype"]


# The ``model:`` section: one field per entry of xorl/models/schema.py FIELDS (its HF name, type,
# default and kind are declared there, once).
ModelConfig = model_config_class()


@dataclass
class DataConfig:
    # the built-in corpus; a local .jsonl / .txt / .parquet / .json / .csv / .arrow file or folder; a folder
    # saved with datasets' save_to_disk; or a Hugging Face hub dataset name (needs a network)
    dataset: str = "builtin"
    # auto (from the first row) | text | messages (chat, rendered with the tokenizer's chat template) |
    # prompt_completion ('prompt' + 'completion') | input_ids (pre-tokenised, optional 'labels', -100 = masked)
    format: Literal["auto", "text", "messages", "prompt_completion", "input_ids"] = "auto"
    # which tokens of messages / prompt_completion rows train: assistant (the replies / the completion) | all
    train_on: Literal["assistant", "all"] = "assistant"
    split: str | None = None  # the split of a hub dataset or a save_to_disk DatasetDict (null: 'train')
    text_key: str = "text"  # the JSONL / parquet field holding each document's text
    tokenizer: str = "byte"  # byte-level, or a local HF tokenizer.json path
    seq_len: int = 128  # tokens per packed sequence
    micro_batch_size: int = 2  # sequences per microbatch on each data-parallel rank
    packing: bool = True  # several documents per sequence (false: one document per sequence, padded)
    # true: read, tokenise and pack the files as training goes (xorl/data/stream.py): bounded memory,
    # the files' order; false: tokenise everything up front and shuffle the packed sequences.
    streaming: bool = False
    seed: int = 0  # the order the packed sequences are shuffled in (and the built-in corpus)
    num_workers: int = 0  # data loader worker processes (0: read in the training process)
    # Validation data (evaluated every train.eval_steps): another source, of the same kinds as dataset...
    eval_dataset: str | None = None
    eval_split: str | None = None  # its split (hub / DatasetDict; null: 'validation')
    # ... or this fraction of the rows of dataset, held out of training (chosen by a hash of each row)
    eval_fraction: float = 0.0


@dataclass
class TrainConfig(ParallelFields):
    """The parallel fields (see xorl/distributed/parallel_config.py) come first, then optimisation."""

    lr: float = 1e-3  # peak learning rate (AdamW), reached after warmup_steps
    # After the warmup: cosine or linear decay to min_lr_ratio x lr at max_steps, constant (no decay), or
    # wsd (warmup-stable-decay: constant, then a 1-sqrt decay over the last decay_fraction of the steps).
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1  # the decay (cosine, linear, wsd) ends at min_lr_ratio x lr at max_steps
    decay_fraction: float = 0.2  # lr_schedule wsd: the fraction of max_steps, at the end, that decays
    warmup_steps: int = 10  # linear warmup steps (at most max_steps: a longer warmup is cut to max_steps)
    max_steps: int = 100  # optimizer steps of the whole run (the schedule's length); see num_epochs
    # Instead of max_steps: passes over the data (may be fractional). The data is packed and counted
    # before start-up, and max_steps = ceil(num_epochs x packed sequences / global batch); not for streaming.
    num_epochs: float | None = None
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on norms and biases)
    adam_betas: tuple[float, float] = (0.9, 0.95)  # AdamW (beta1, beta2)
    adam_eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # 0: no clipping
    seed: int = 0  # the seeded initialisation of a model without model_path
    # bfloat16: bf16 compute with fp32 master weights, on GPU under FSDP2 (CPU runs compute in float32).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # none | full | selective (keep matmul / attention / collective outputs, recompute the rest);
    # true / false read as full / none. Full checkpointing applies to every n-th decoder block.
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"
    activation_checkpointing_every_n_layers: int = 1  # with full checkpointing: every n-th decoder block
    # With selective checkpointing, which matmul outputs a block keeps: every one ("matmuls"), or
    # every other one in the order the block runs them ("every_other_matmul", torchtitan's op-level
    # SAC: of q, k, v, o, gate, up, down it recomputes k, o and up; less memory, more FLOPs).
    selective_checkpoint: Literal["matmuls", "every_other_matmul"] = "matmuls"
    # FSDP2 sharding level: "always" frees each block's gathered parameters after its forward
    # (ZeRO-3), "never" keeps them to the backward (ZeRO-2: less all-gather, more memory);
    # "default" is always, except for zero-bubble pipeline schedules, which need never.
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    # Under pipeline parallelism with FSDP2, when a stage reduce-scatters its gradients:
    # "per_microbatch" reshards each block after every microbatch's backward and reduce-scatters its
    # gradient then (memory stays sharded); "per_step" keeps torch's PipelineStage behaviour, as
    # torchtitan and Megatron run it: the stage's gradients stay unsharded (fp32) across the
    # microbatches and are reduce-scattered once, after the last (with fsdp_reshard_after_forward:
    # never the stage's parameters are also gathered once per step). "default" is per_microbatch,
    # except for zero-bubble schedules, which are per_step (their weight pass needs it).
    pipeline_grad_sync: Literal["default", "per_microbatch", "per_step"] = "default"
    # torch.compile each decoder block (true: inductor; "aot_eager": no code generation, for debugging).
    compile: Literal["inductor", "aot_eager"] | bool = False
    # FP8 GEMMs in the dense linears (attention and MLP projections; lm_head and router stay in
    # dtype) and, with blockwise, the MoE experts: tensorwise | rowwise scales per tensor / row,
    # blockwise 1x128 activations and 128x128 weights (DeepSeek-V3). A compute choice: master
    # weights, optimizer state and checkpoints are unchanged (xorl_kernels/fp8).
    fp8: Literal["none", "tensorwise", "rowwise", "blockwise"] = "none"
    # With fp8: tensorwise under FSDP2: all-gather those linears' weights in float8 (half of bf16's
    # bytes), each shard cast with the whole weight's scale (xorl/nn/fp8_all_gather.py).
    fp8_all_gather: bool = False
    output_dir: str = "outputs"  # the run folder: config.yaml, metrics.jsonl, checkpoints/
    save_steps: int = 0  # a checkpoint every save_steps steps (0: none periodic); max_steps is always saved
    resume: bool | str = False  # true: latest checkpoint in output_dir; a path: that checkpoint
    # On resume, when lr / schedule / AdamW settings differ from the checkpoint's: "error" refuses
    # (listing each), "checkpoint" keeps the checkpoint's values, "config" applies the new ones.
    resume_hparams: Literal["error", "checkpoint", "config"] = "error"
    # A fresh run into a non-empty output_dir is refused unless this empties it first.
    overwrite_output_dir: bool = False
    log_steps: int = 1  # a console line every log_steps steps (metrics.jsonl gets every step)
    # Evaluate the eval data (data.eval_dataset / eval_fraction) every eval_steps steps and at the end (0: never)
    eval_steps: int = 0
    eval_batches: int = 0  # global batches per evaluation (0: the whole eval set)
    # Weights & Biases (pip install -e .[logging]): rank 0 logs every step's metrics to this project;
    # its files go to output_dir/wandb. null: no W&B.
    wandb_project: str | None = None
    wandb_run_name: str | None = None  # the W&B run's name (null: output_dir's folder name)
    # offline: write the W&B run to output_dir/wandb only (`wandb sync` uploads it later); null: the
    # WANDB_MODE environment variable decides (online when unset).
    wandb_mode: Literal["online", "offline"] | None = None
    tensorboard: bool = False  # rank 0 writes every step's metrics to output_dir/tensorboard (the logging extra)
    # [start, end]: torch.profiler records steps start..end (1-based, as on the console) on every rank and
    # writes a Chrome trace per rank to output_dir/profile/rank{r}/; []: no profiling.
    profile_steps: list[int] = field(default_factory=list)
    # A CUDA memory snapshot (allocations since training started, with stacks) after this step (1-based), per
    # rank in output_dir/memory_snapshot/ (open it at pytorch.org/memory_viz); GPU-only; null: none.
    memory_snapshot_step: int | None = None
    export_hf: bool = False  # write output_dir/hf (a Hugging Face folder) at the end
    # Every collective fails after this long (a stalled or dead rank ends the job, not hangs it).
    collective_timeout_s: float = 600.0
    # Rank 0 prints a line every heartbeat_s while a step or save takes longer than that (0: never).
    heartbeat_s: float = 60.0
    # On one of these signals the job finishes the current step, saves a checkpoint and exits with code 75
    # (xorl/run/preemption.py); a second signal exits at once; [] turns it off.
    preempt_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"]] = field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # Seconds from a preemption signal to the exit at the latest (set it below the scheduler's grace).
    preempt_grace_s: float = 120.0
    # With resume=PATH inside output_dir: move the run's later checkpoints aside (checkpoints/discarded/).
    discard_later: bool = False


def compute_dtype(train: TrainConfig, device_type: str) -> str:
    """The dtype a run computes in: ``train.dtype: bfloat16`` is FSDP2's mixed-precision policy (bf16
    matmuls, fp32 master weights and gradient reduction) on GPU; on CPU and without FSDP2 it is float32."""
    if train.dtype == "bfloat16" and device_type == "cuda" and train.data_parallel_mode == "fsdp2":
        return "bfloat16"
    return "float32"


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # "section.key" -> where it was set explicitly ("run.yaml", "--model.rope_theta=1e4"); not compared.
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain dicts and lists (tuples become lists), ready for YAML / JSON."""
        return {name: _plain(dataclasses.asdict(getattr(self, name))) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "config") -> Config:
        config = cls()
        problems = apply_dict(config, data, source)
        if problems:
            raise ConfigError(problems)
        return config

    def validate(self, world_size: int, *, local: bool = True) -> Config:
        validate_config(self, world_size, local=local)
        return self


# -- --help: every key, its default and its meaning, read from the dataclasses above ---------------
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its comment in the source (a trailing ``# ...``, else the comment block just above
    it), for ``cls`` and its dataclass bases; the model section's from its schema's ``doc``. Why: they
    are the fields' one documentation, so ``xorl-train --help`` cannot drift from what the code says."""
    import inspect

    if cls is ModelConfig:  # made from xorl/models/schema.py, where each field carries its doc
        from xorl.models.schema import FIELDS

        return {f.name: f.doc for f in FIELDS if f.doc}
    docs: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        names = set(klass.__dict__.get("__annotations__", {}))
        block: list[str] = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            stripped = line.strip()
            if stripped.startswith("#"):
                block.append(stripped.lstrip("#").strip())
                continue
            name = stripped.split(":", 1)[0].strip()
            if name in names and ":" in stripped:
                trailing = stripped.split("  # ", 1)[1].strip() if "  # " in stripped else ""
                docs[name] = trailing or " ".join(block)
            block = []
    return docs


def config_help() -> str:
    """Each section's keys with default and meaning: the body of ``xorl-train --help``."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        docs, defaults = field_docs(cls), dataclasses.asdict(cls())
        for name, hint in _type_hints(cls).items():
            value = json.dumps(_plain(defaults[name]))
            lines.append(f"  {name}: {value}  ({_type_name(hint)}) {docs.get(name, '')}".rstrip())
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- setting a field: its type checked, old spellings named, the closest name suggested -----------------
def apply_dict(config: Config, data: Any, source: str) -> list[str]:
    """Set every field of a YAML mapping; return the problems (all of them, not just the first)."""
    if data is None:
        return []
    if not isinstance(data, dict):
        return [f"{source}: the top level must be a mapping of sections {list(SECTIONS)}"]
    problems = []
    for section, values in data.items():
        if section not in SECTIONS:
            problems += collect_problems(_check_section, section, source)
        elif values is not None and not isinstance(values, dict):
            problems.append(f"{source}: section {section!r} must be a mapping of key: value")
        else:
            for key, value in (values or {}).items():
                problems += collect_problems(set_field, config, section, key, value, source)
    return problems


def collect_problems(fn, *args, **kwargs) -> list[str]:
    """Run ``fn``; its ConfigError's problems as a list (empty when it passed)."""
    try:
        fn(*args, **kwargs)
    except ConfigError as e:
        return e.problems
    return []


def _check_section(section: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown config section {section!r}{did_you_mean(str(section), SECTIONS)}; "
            f"the sections are {list(SECTIONS)}"
        )


def set_field(
    config: Config, section: str, key: Any, value: Any, source: str, raw: str | None = None
) -> None:
    """Type-check ``value`` for ``section.key`` and set it; errors name the field."""
    _check_section(section, source)
    section_cls = SECTIONS[section]
    hints = _type_hints(section_cls)
    if key not in hints:
        raise ConfigError(f"{source}: unknown key {section}.{key}{unknown_key_hint(section, str(key))}")
    name = f"{section}.{key}"
    try:
        try:
            coerced = coerce(value, hints[key], name)
        except ConfigError:
            # An override like --train.output_dir=123 reads as an int; a str field takes the text as written.
            if raw is None or not _accepts_str(hints[key]):
                raise
            coerced = coerce(raw, hints[key], name)
    except ConfigError as e:
        if source.startswith("--") or source == "config":
            raise
        raise ConfigError(f"{source}: {e}") from None  # name the file the value came from
    setattr(getattr(config, section), key, coerced)
    config.origins[name] = source


# Other trainers' names (transformers' TrainingArguments, torchtitan, Megatron, axolotl) for xorl's
# fields. Only suggested in the error for an unknown key, never accepted: one name per setting.
KEY_ALIASES = {
    "learning_rate": "train.lr", "lr_warmup_steps": "train.warmup_steps", "warmup": "train.warmup_steps",
    "num_warmup_steps": "train.warmup_steps", "train_steps": "train.max_steps", "total_steps": "train.max_steps",
    "max_train_steps": "train.max_steps", "training_steps": "train.max_steps", "steps": "train.max_steps",
    "min_lr": "train.min_lr_ratio", "adam_epsilon": "train.adam_eps", "adam_beta1": "train.adam_betas",
    "adam_beta2": "train.adam_betas", "betas": "train.adam_betas", "max_norm": "train.max_grad_norm",
    "grad_clip": "train.max_grad_norm", "clip_grad_norm": "train.max_grad_norm", "gradient_clipping":
    "train.max_grad_norm", "torch_dtype": "train.dtype", "bf16": "train.dtype", "mixed_precision": "train.dtype",
    "precision": "train.dtype", "output_path": "train.output_dir", "save_dir": "train.output_dir",
    "out_dir": "train.output_dir", "checkpointing_steps": "train.save_steps", "save_interval":
    "train.save_steps", "checkpoint_interval": "train.save_steps", "logging_steps": "train.log_steps",
    "log_interval": "train.log_steps", "log_freq": "train.log_steps", "resume_from_checkpoint": "train.resume",
    "gradient_checkpointing": "train.activation_checkpointing", "gradient_accumulation":
    "train.gradient_accumulation_steps", "grad_accum_steps": "train.gradient_accumulation_steps",
    "tp_size": "train.tensor_parallel_size", "tensor_parallel_degree": "train.tensor_parallel_size",
    "pp_size": "train.pipeline_parallel_size", "pipeline_parallel_degree": "train.pipeline_parallel_size",
    "ep_size": "train.expert_parallel_size", "sequence_parallel_size": "train.ulysses_parallel_size",
    "context_parallel_size": "train.ringattn_parallel_size", "cp_size": "train.ringattn_parallel_size",
    "per_device_train_batch_size": "data.micro_batch_size", "batch_size": "data.micro_batch_size",
    "micro_batch": "data.micro_batch_size", "max_seq_length": "data.seq_len", "max_seq_len": "data.seq_len",
    "seq_length": "data.seq_len", "sequence_len": "data.seq_len", "block_size": "data.seq_len",
    "max_length": "data.seq_len", "dataset_path": "data.dataset", "data_path": "data.dataset",
    "train_file": "data.dataset", "dataset_name": "data.dataset", "tokenizer_name": "data.tokenizer",
    "tokenizer_path": "data.tokenizer", "sample_packing": "data.packing", "dataloader_num_workers":
    "data.num_workers", "model_name_or_path": "model.model_path", "pretrained_model_name_or_path":
    "model.model_path", "base_model": "model.model_path", "num_layers": "model.num_hidden_layers",
    "n_layers": "model.num_hidden_layers", "n_heads": "model.num_attention_heads",
}


# Bare words whose meaning depends on the section they were written under (axolotl's datasets[].path,
# a data or model "path"): suggested only there.
SECTION_KEY_ALIASES = {
    ("data", "path"): "data.dataset", ("data", "file"): "data.dataset", ("data", "files"): "data.dataset",
    ("data", "data_files"): "data.dataset", ("data", "train_path"): "data.dataset",
    ("data", "datasets"): "data.dataset", ("model", "path"): "model.model_path",
    ("model", "name"): "model.model_path", ("model", "name_or_path"): "model.model_path",
}


def unknown_key_hint(section: str, key: str) -> str:
    """What follows ``unknown key section.key``: the section that has it, the xorl name of another
    trainer's key, or the close matches; then a pointer to ``--help`` (not every key of the section)."""
    others = [s for s, cls in SECTIONS.items() if s != section and key in _type_hints(cls)]
    if others:
        return f"; {key!r} is in the {others[0]!r} section: use {others[0]}.{key}"
    target = SECTION_KEY_ALIASES.get((section, key.lower())) or KEY_ALIASES.get(key.lower())
    if target is not None:
        target_section, target_key = target.split(".")
        return f" (did you mean {repr(target_key) if target_section == section else target}?)"
    guess = did_you_mean(key, _type_hints(SECTIONS[section]))
    return f"{guess}; `xorl-train --help` lists every key with its default"
