"""`xorl-export CHECKPOINT_DIR OUT_DIR`: a training checkpoint -> a Hugging Face safetensors folder.

One process on the CPU: no GPU and no process group of the training size. CHECKPOINT_DIR is a
checkpoint (``.../checkpoints/step_00000100``), a run's ``checkpoints`` folder or its output_dir
(then the checkpoint ``latest`` names). The model's shape comes from the checkpoint's
``model_config.json`` (``--config RUN.yaml`` for a checkpoint saved without one). OUT_DIR must not
exist yet: an export never overwrites a folder. Peak host memory is one tensor of the model
(xorl/checkpoint/hf_export.py), whatever its size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportError(Exception):
    """A problem with the command's arguments: printed as one line, without a traceback."""


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 (transformers' units: KB/MB/GB powers of 10, KiB/MiB/GiB of 2)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in _UNITS:
        raise ExportError(f"--max-shard-size={text!r}: give bytes or a size like 5GB, 500MB, 2GiB")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder (holding DCP's .metadata) from a checkpoint, checkpoints root or output_dir."""
    from xorl.checkpoint.state import LATEST

    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.isfile(os.path.join(root, ".metadata")):
            return root
        pointer = os.path.join(root, LATEST)
        if os.path.isfile(pointer):
            with open(pointer, encoding="utf-8") as f:
                found = os.path.join(root, f.read().strip())
            if os.path.isfile(os.path.join(found, ".metadata")):
                return found
            raise ExportError(f"{pointer} names {found}, which is not a complete checkpoint")
    raise ExportError(
        f"CHECKPOINT_DIR={path!r} is not a checkpoint: give a step folder (holding .metadata), "
        "a run's checkpoints folder or its output_dir (holding checkpoints/latest)"
    )


def model_config_for(checkpoint: str, config_path: str | None):
    from xorl.checkpoint.state import MODEL_CONFIG
    from xorl.config import Config, load_config

    if config_path:
        return load_config(config_path, []).model
    stored = os.path.join(checkpoint, MODEL_CONFIG)
    if not os.path.isfile(stored):
        raise ExportError(f"{checkpoint} has no {MODEL_CONFIG} (saved by an older xorl): pass --config RUN.yaml")
    with open(stored, encoding="utf-8") as f:
        return Config.from_dict({"model": json.load(f)}, source=stored).model


def _check_layout(checkpoint: str, model_config) -> None:
    """A checkpoint of an older parameter layout (preflight.layout_problems): a merge_qkv one would
    export with its heads mixed."""
    from xorl.run.folder import TRAINER_STATE_NAME
    from xorl.run.preflight import layout_problems

    state_path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    state = {}
    if os.path.isfile(state_path):
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
    problems = layout_problems(model_config, state, checkpoint, fix="export it with the xorl that saved it")
    if problems:
        raise ExportError(problems[0])


def _check_exportable(model_config) -> None:
    """A model the family's transformers class cannot hold (e.g. a Qwen3-MoE trained with a sigmoid
    router): refused here, before any tensor is read, in one line (it used to end in a traceback
    from inside the export)."""
    from xorl.models.families import family
    from xorl.models.hf_config import fields_to_hf
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(model_config)
    fields_to_hf(spec, family(spec.model_type))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xorl-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="cast floating-point weights (default: as saved, fp32 master weights)")
    parser.add_argument("--config", help="the run's YAML, for a checkpoint without model_config.json")
    parser.add_argument("--report", metavar="JSON", help="also write the export's peak host memory and time here")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint's adapter alone, in peft's format (adapter_config.json + "
                             "adapter_model.safetensors), instead of the merged model")
    args = parser.parse_args(argv)
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
        checkpoint = resolve_checkpoint(args.checkpoint_dir)
        if os.path.exists(args.out_dir) and (not os.path.isdir(args.out_dir) or os.listdir(args.out_dir)):
            raise ExportError(f"OUT_DIR={args.out_dir!r} exists: give a new folder (an export never overwrites one)")
        model_config = model_config_for(checkpoint, args.config)
        _check_layout(checkpoint, model_config)
        if args.adapter and not model_config.lora:
            raise ExportError(f"--adapter: {checkpoint} was trained without model.lora, so it has no adapter; "
                              "export the model without --adapter")
        _check_exportable(model_config)
    except (ExportError, ValueError) as err:  # ConfigError is a ValueError
        print(f"xorl-export: {err}", file=sys.stderr)
        return 2
    import torch

    from xorl.checkpoint.hf_export import export_checkpoint

    if os.path.isdir(args.out_dir):
        os.rmdir(args.out_dir)  # empty (checked above): the export moves a complete folder here
    if args.adapter:
        from xorl.checkpoint.peft_adapter import export_adapter

        try:
            export_adapter(checkpoint, args.out_dir, model_config)
        except ValueError as err:
            print(f"xorl-export: {err}", file=sys.stderr)
            return 2
        return 0
    dtype = getattr(torch, args.dtype) if args.dtype else None
    export_checkpoint(checkpoint, args.out_dir, model_config, max_shard_bytes=max_shard_bytes, dtype=dtype,
                      report_path=args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
