"""The run config: ``model:``, ``data:`` and ``train:`` sections, read from YAML plus CLI overrides.

    config = load_config("run.yaml", ["--train.lr=3e-4", "--train.tensor_parallel_size", "2"])
    validate_config(config, world_size)   # every cross-field rule; before any process group exists

Loading checks names and types only (unknown keys and wrong types are errors naming the field,
with the closest valid name; every problem of the file and the overrides is reported at once);
``validate_config`` (xorl/config_rules.py) checks the rules that tie fields together and to the
world size. ``Config()`` is a tiny dense model valid for 1 process.

With ``model.model_path`` the folder's config.json defines the model: ``load_config`` fills the
model fields from it, and a field the YAML or CLI set to another value is an error naming both
(xorl/model_path.py). ``Config.origins`` records where each explicitly set field came from.

Model field names are the Hugging Face config attribute names, so the models accept either a
``ModelConfig`` or a ``transformers`` config. ``head_dim: null`` means hidden_size // heads.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from xorl.config_error import ConfigError, did_you_mean
from xorl.config_rules import validate_config
from xorl.distributed.parallel_config import ParallelFields
from xorl.models.schema import model_config_class

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "load_config",
    "parse_overrides",
    "validate_config",
]


# The ``model:`` section: one field per entry of xorl/models/schema.py FIELDS (its HF name, type,
# default and kind are declared there, once).
ModelConfig = model_config_class()


@dataclass
class DataConfig:
    dataset: str = "builtin"  # the built-in corpus, or a local .jsonl / .txt / .parquet path
    text_key: str = "text"
    tokenizer: str = "byte"  # byte-level, or a local HF tokenizer.json path
    seq_len: int = 128
    micro_batch_size: int = 2
    packing: bool = True
    # true: read, tokenise and pack the files as training goes (xorl/data/stream.py): bounded memory,
    # the files' order; false: tokenise everything up front and shuffle the packed sequences.
    streaming: bool = False
    seed: int = 0
    num_workers: int = 0


@dataclass
class TrainConfig(ParallelFields):
    """The parallel fields (see xorl/distributed/parallel_config.py) come first, then optimisation."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    max_steps: int = 100
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    # none | full | selective (keep matmul / attention / collective outputs, recompute the rest);
    # true / false read as full / none. Full checkpointing applies to every n-th decoder block.
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"
    activation_checkpointing_every_n_layers: int = 1
    # FSDP2 sharding level: "always" frees each block's gathered parameters after its forward
    # (ZeRO-3), "never" keeps them to the backward (ZeRO-2: less all-gather, more memory);
    # "default" is always, except for zero-bubble pipeline schedules, which need never.
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    # torch.compile each decoder block (true: inductor; "aot_eager": no code generation, for debugging).
    compile: Literal["inductor", "aot_eager"] | bool = False
    # FP8 GEMMs in the dense linears (attention and MLP projections; lm_head and router stay in
    # dtype) and, with blockwise, the MoE experts: tensorwise | rowwise scales per tensor / row,
    # blockwise 1x128 activations and 128x128 weights (DeepSeek-V3). A compute choice: master
    # weights, optimizer state and checkpoints are unchanged (xorl_kernels/fp8).
    fp8: Literal["none", "tensorwise", "rowwise", "blockwise"] = "none"
    output_dir: str = "outputs"
    save_steps: int = 0  # 0: no periodic checkpoints
    resume: bool | str = False  # true: latest checkpoint in output_dir; a path: that checkpoint
    # On resume, when lr / schedule / AdamW settings differ from the checkpoint's: "error" refuses
    # (listing each), "checkpoint" keeps the checkpoint's values, "config" applies the new ones.
    resume_hparams: Literal["error", "checkpoint", "config"] = "error"
    # A fresh run into a non-empty output_dir is refused unless this empties it first.
    overwrite_output_dir: bool = False
    log_steps: int = 1
    export_hf: bool = False
    # Every collective fails after this long (a stalled or dead rank ends the job, not hangs it).
    collective_timeout_s: float = 600.0
    # Rank 0 prints a line every heartbeat_s while a step or save takes longer than that (0: never).
    heartbeat_s: float = 60.0
    # Preemption (xorl/preemption.py): on one of these signals the job finishes the current step, saves a
    # checkpoint and exits with code 75, within preempt_grace_s (after it: exit at once); [] turns it off.
    preempt_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"]] = field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    preempt_grace_s: float = 120.0
    # With resume=PATH inside output_dir: move the run's later checkpoints aside (checkpoints/discarded/).
    discard_later: bool = False


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
        problems = _apply_dict(config, data, source)
        if problems:
            raise ConfigError(problems)
        return config

    def validate(self, world_size: int) -> Config:
        validate_config(self, world_size)
        return self


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- loading -------------------------------------------------------------------------------
def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read ``path`` (YAML; None: defaults), then apply ``--section.key=value`` overrides in order,
    then fill the model from ``model.model_path``'s config.json. Raises one ConfigError listing
    every problem found (each wrong name or type, each conflict with the model folder)."""
    data = None
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    config = Config()
    problems = _apply_dict(config, data, path or "config")
    parsed, override_problems = _parse_overrides(overrides or [])
    problems += override_problems
    for section, key, raw in parsed:
        source = f"--{section}.{key}={raw}"
        problems += _collect(set_field, config, section, key, _parse_scalar(raw), source, raw=raw)
    if not problems and config.model.model_path is not None:
        from xorl.model_path import apply_model_path

        problems += apply_model_path(config)
    if problems:
        raise ConfigError(problems)
    return config


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
        others = [s for s, cls in SECTIONS.items() if s != section and key in _type_hints(cls)]
        hint = (
            f"; {key!r} is in the {others[0]!r} section: use {others[0]}.{key}"
            if others
            else did_you_mean(str(key), list(hints)) or f"; the keys of {section} are {list(hints)}"
        )
        raise ConfigError(f"{source}: unknown key {section}.{key}{hint}")
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


_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS_CACHE:
        names = {f.name for f in dataclasses.fields(cls)}
        _HINTS_CACHE[cls] = {k: v for k, v in get_type_hints(cls).items() if k in names}
    return _HINTS_CACHE[cls]


def _accepts_str(tp: Any) -> bool:
    return tp is str or (_is_union(tp) and str in get_args(tp))


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if _is_union(tp):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if get_origin(tp) in (list, tuple):
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, name: str) -> Any:
    """``value`` as type ``tp`` (int, float, bool, str, Literal, X | None, list[X], tuple[X, ...])."""
    origin = get_origin(tp)
    wrong = ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise ConfigError(
            f"{name}={value!r} is not one of {list(choices)}"
            + did_you_mean(str(value), [str(c) for c in choices])
        )
    if _is_union(tp):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ConfigError:
                continue
        raise wrong
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise wrong
        (item_tp,) = get_args(tp)
        return [coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        item_tps = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_tps):
            raise ConfigError(
                f"{name}: expected a list of {len(item_tps)} values ({_type_name(tp)}), got {value!r}"
            )
        return tuple(coerce(v, t, f"{name}[{i}]") for i, (v, t) in enumerate(zip(value, item_tps)))
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise wrong
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "3e-4" (no dot) as a string; it is plainly a float.
            try:
                return float(value)
            except ValueError:
                pass
        raise wrong
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r} ({type(value).__name__}); quote it")
    raise TypeError(f"{name}: unsupported field type {tp!r}")  # a bug in the dataclass, not in the input
