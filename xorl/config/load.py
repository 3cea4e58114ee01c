"""Reading a run config: YAML plus ``--section.key=value`` overrides, checked for names and types.

    config = load_config("run.yaml", ["--train.lr=3e-4", "--train.tensor_parallel_size", "2"])

Every problem of the file and the overrides (an unknown key, with the closest valid name; a wrong
type; a key set twice) is reported at once, in one ConfigError. The sections themselves are
declared in xorl/config/sections.py; the rules that tie fields together in xorl/config/validate.py.
"""

from __future__ import annotations

from typing import Any

import yaml

from xorl.config.errors import ConfigError
from xorl.config.sections import SECTIONS, Config, apply_dict, collect_problems, set_field


# -- loading -------------------------------------------------------------------------------
def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read ``path`` (YAML; None: defaults), then apply ``--section.key=value`` overrides in order,
    then fill the model from ``model.model_path``'s config.json. Raises one ConfigError listing
    every problem found (each wrong name or type, each conflict with the model folder)."""
    data, problems = None, []
    if path is not None:
        data, problems = read_yaml(path)
    config = Config()
    problems += apply_dict(config, data, path or "config")
    parsed, override_problems = _parse_overrides(overrides or [])
    problems += override_problems
    for section, key, raw in parsed:
        source = f"--{section}.{key}={raw}"
        problems += collect_problems(set_field, config, section, key, _parse_scalar(raw), source, raw=raw)
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


