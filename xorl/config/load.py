"""Reading a run config: YAML plus ``--section.key=value`` overrides, checked for names and types.

    config = load_config("run.yaml", ["--train.lr=3e-4", "--train.tensor_parallel_size", "2"])

Every problem of the file and the overrides (an unknown key, with the closest valid name; a wrong
type; a key set twice) is reported at once, in one ConfigError. The sections themselves are
declared in xorl/config/sections.py; the rules that tie fields together in xorl/config/validate.py.
"""

from __future__ import annotations

from typing import Any

import yaml

from xorl.config.errors import ConfigError, did_you_mean
from xorl.config.field_types import accepts_str as _accepts_str
from xorl.config.field_types import coerce
from xorl.config.field_types import type_hints as _type_hints
from xorl.config.sections import SECTIONS, Config


# -- loading -------------------------------------------------------------------------------
def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read ``path`` (YAML; None: defaults), then apply ``--section.key=value`` overrides in order,
    then fill the model from ``model.model_path``'s config.json. Raises one ConfigError listing
    every problem found (each wrong name or type, each conflict with the model folder)."""
    data, problems = None, []
    if path is not None:
        data, problems = read_yaml(path)
    config = Config()
    problems += _apply_dict(config, data, path or "config")
    parsed, override_problems = _parse_overrides(overrides or [])
    problems += override_problems
    for section, key, raw in parsed:
        source = f"--{section}.{key}={raw}"
        problems += _collect(set_field, config, section, key, _parse_scalar(raw), source, raw=raw)
    if not problems and config.model.model_path is not None:
        from xorl.config.model_path import apply_model_path

        problems += apply_model_path(config)
    if not problems and config.model.lora:  # peft's target_modules "all-linear", once the family is known
        from xorl.nn.lora import expand_all_linear

        config.model.lora = expand_all_linear(config.model.lora, config.model.num_experts)
    if problems:
        raise ConfigError(problems)
    return config


def read_yaml(path: str) -> tuple[Any, list[str]]:
    """(the YAML file's data, one problem per duplicated key). Why the check: PyYAML keeps the last of
    two equal keys without a word, so a key set twice in a long config silently loses its first value."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e.reason}") from None
    try:
        return yaml.safe_load(text), _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e


def _duplicate_keys(node: Any, path: str, prefix: str = "") -> list[str]:
    """``path:line: key 'train.lr' is set twice (also at line 2)`` for every mapping key repeated in ``node``."""
    problems = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key is not None and key in first_line:
                problems.append(f"{path}:{line}: key {prefix + key!r} is set twice (also at line {first_line[key]}); "
                                "YAML would keep only the last value: remove one of them")
            elif key is not None:
                first_line[key] = line
            problems += _duplicate_keys(value_node, path, f"{prefix}{key}." if key is not None else prefix)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            problems += _duplicate_keys(item, path, prefix)
    return problems


def _apply_dict(config: Config, data: Any, source: str) -> list[str]:
    """Set every field of a YAML mapping; return the problems (all of them, not just the first)."""
    if data is None:
        return []
    if not isinstance(data, dict):
        return [f"{source}: the top level must be a mapping of sections {list(SECTIONS)}"]
    problems = []
    for section, values in data.items():
        if section not in SECTIONS:
            problems += _collect(_check_section, section, source)
        elif values is not None and not isinstance(values, dict):
            problems.append(f"{source}: section {section!r} must be a mapping of key: value")
        else:
            for key, value in (values or {}).items():
                problems += _collect(set_field, config, section, key, value, source)
    return problems


def _collect(fn, *args, **kwargs) -> list[str]:
    """Run ``fn``; its ConfigError's problems as a list (empty when it passed)."""
    try:
        fn(*args, **kwargs)
    except ConfigError as e:
        return e.problems
    return []


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """``["--train.lr=3e-4", "--data.seq_len", "256"]`` -> ``[(section, key, raw_value), ...]``."""
    parsed, problems = _parse_overrides(args)
    if problems:
        raise ConfigError(problems)
    return parsed


def _parse_overrides(args: list[str]) -> tuple[list[tuple[str, str, str]], list[str]]:
    result, problems = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        body = arg[2:] if arg.startswith("--") else arg
        i += 1
        if "=" in body:
            name, raw = body.split("=", 1)
        elif arg.startswith("--") and i < len(args) and not args[i].startswith("--"):
            name, raw = body, args[i]
            i += 1
        else:
            problems.append(f"override {arg!r} has no value; write it as --section.key=value")
            continue
        if name.count(".") != 1 or not all(name.split(".")):
            problems.append(
                f"override {arg!r}: the name must be section.key with a section in {list(SECTIONS)}, "
                "e.g. --train.lr=3e-4"
            )
            continue
        section, key = name.split(".")
        result.append((section, key, raw))
    return result, problems


def _parse_scalar(raw: str) -> Any:
    """A YAML scalar or flow list: ``3``, ``0.5``, ``true``, ``null``, ``[1, 2]``; else the raw string."""
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


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


