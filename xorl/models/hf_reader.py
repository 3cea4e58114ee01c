"""Hugging Face safetensors checkpoints -> xorl models, from a local folder (no hub access).
The name and layout conversions are xorl/models/hf_layout.py; writing is xorl/models/hf_writer.py.

Parallel models: each rank loads only the boxes its DTensor shards (FSDP2 / TP / EP) hold, read
lazily from the files (``get_slice``), and a pipeline stage only its own layers; expert-parallel
MoE blocks that hold a plain slice of the experts (``local_expert_range``) get their slice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from xorl.distributed.shard_box import ShardBox, local_tensor, parameter_box
from xorl.models import fp8_blocks
from xorl.models.hf_layout import INDEX_NAME, SINGLE_NAME, FileNames, _plan, _Recipe
from xorl.models.param_names import clean_name

logger = logging.getLogger(__name__)

# Each rank reads only the box of each checkpoint tensor that its own shards need (safetensors'
# lazy ``get_slice``), converted to xorl's layout on the way (hf_layout.py's recipes): a rank never
# holds a full copy of the model, and at most one expert's or one projection's box of it beyond its
# own shards.


def _checkpoint_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(folder, SINGLE_NAME)):
        return [SINGLE_NAME]
    names = os.listdir(folder) if os.path.isdir(folder) else []
    files = sorted(f for f in names if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (nor {INDEX_NAME}) in {folder!r}")
    return files


class _SliceReader:
    """Boxes of checkpoint tensors, read lazily; at most one file open at a time.

    Why one: safetensors maps a file into memory, and the pages a read touched count as this
    process's resident memory until the file is closed.
    """

    def __init__(self, folder: str, names: FileNames | None = None):
        self.folder = folder
        self.files = _checkpoint_files(folder)
        self.file_of: dict[str, str] = {}  # by common name (FileNames)
        self.key_of: dict[str, str] = {}  # common name -> the key in the file
        self.shapes: dict[str, tuple[int, ...]] = {}
        names = names or FileNames(None)
        self.ignored_layers: set[str] = set()  # "model.layers.{i}" the files hold past the model's layers
        # Block-quantised FP8 folders (xorl/models/fp8_blocks.py): weight common name -> its scales' key.
        self.fp8_block = fp8_blocks.block_size(folder)
        self.scale_key_of: dict[str, str] = {}
        self.scale_file_of: dict[str, str] = {}
        for file in self.files:
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for key in f.keys():
                    if names.ignored(key):
                        self.ignored_layers.add(".".join(key.split(".")[:3]))
                        continue
                    if self.fp8_block is not None and key.endswith(fp8_blocks.SCALE_SUFFIX):
                        weight = names.common_name(key.removesuffix(fp8_blocks.SCALE_SUFFIX))
                        self.scale_key_of[weight] = key
                        self.scale_file_of[key] = file  # not a source of its own: read with its weight
                        continue
                    name = names.common_name(key)
                    self.file_of[name] = file
                    self.key_of[name] = key
                    self.shapes[name] = tuple(f.get_slice(key).get_shape())
        self._open: str | None = None
        self._stack = contextlib.ExitStack()
        self._handle = None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def __call__(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        if key in self.scale_key_of:  # an FP8 block-quantised weight: the box dequantised
            return fp8_blocks.dequantize_box(self._read, key, self.scale_key_of[key], index, self.shapes[key],
                                             self.fp8_block)
        return self._read(key, index)

    def _read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        file = self.file_of[key] if key in self.file_of else self.scale_file_of[key]
        if file != self._open:
            self.close()
            self._handle = self._stack.enter_context(safe_open(os.path.join(self.folder, file), framework="pt"))
            self._open = file
        return self._handle.get_slice(self.key_of.get(key, key))[index]

    def close(self) -> None:
        self._stack.close()
        self._open, self._handle = None, None


def _load_targets(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """clean name -> (name in ``model``, parameter or persistent buffer). LoRA adapters are not in a
    base model's folder: they start from their own initialisation (xorl/nn/lora.py)."""
    from xorl.nn.lora import is_adapter_name

    return {clean_name(raw): (raw, tensor) for raw, tensor in model.state_dict(keep_vars=True).items()
            if not is_adapter_name(raw)}


def _absent_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Names of the parts a pipeline stage does not hold (their checkpoint keys are not unexpected)."""
    decoder = getattr(model, "model", None)
    absent = []
    for i, layer in enumerate(getattr(decoder, "layers", None) or []):
        if layer is None:
            absent.append(f"model.layers.{i}.")
    for owner, attr, prefix in ((decoder, "embed_tokens", "model.embed_tokens."), (decoder, "norm", "model.norm."),
                                (model, "lm_head", "lm_head.")):
        if owner is not None and hasattr(owner, attr) and getattr(owner, attr) is None:
            absent.append(prefix)
    return tuple(absent)


@dataclass
class _Match:
    """A model against a checkpoint folder, from the names and shapes alone (no tensor data read)."""

    reader: _SliceReader
    targets: dict[str, tuple[str, torch.Tensor]]
    recipes: dict[str, _Recipe]
    boxes: dict[str, ShardBox]
    missing: list[str]
    unexpected: list[str]
    mismatches: list[str]


def _match(model: nn.Module, folder: str) -> _Match:
    reader = _SliceReader(folder, FileNames(getattr(model, "spec", None)))
    sources = set(reader.file_of)
    tied = bool(getattr(getattr(model, "spec", None), "tie_word_embeddings", False))
    targets = _load_targets(model)
    recipes = _plan(list(targets), sources, tied, getattr(model, "spec", None))
    used = {s for r in recipes.values() for s in r.sources}
    missing = sorted(used - sources)
    ignored = {"lm_head.weight"} if tied or "lm_head.weight" not in targets else set()
    absent = _absent_prefixes(model)
    unexpected = sorted(s for s in sources - used - ignored if not s.startswith(absent))
    boxes, mismatches = {}, []
    if not missing:
        for name, (raw, tensor) in targets.items():
            boxes[name] = parameter_box(model, raw, tensor)
            expected = recipes[name].shape(reader.shapes)
            if tuple(expected) != boxes[name].global_shape:
                mismatches.append(f"{name}: checkpoint {tuple(expected)} vs model {boxes[name].global_shape}")
    return _Match(reader, targets, recipes, boxes, missing, unexpected, mismatches)


def hf_folder_problems(model: nn.Module, folder: str) -> list[str]:
    """What stops ``folder`` loading into ``model`` (it may be on the meta device); [] if nothing.

    Reads the file headers only, so the trainer checks a folder before any process group starts.
    """
    try:
        match = _match(model, folder)
    except (OSError, ValueError, KeyError) as err:  # a missing folder, a broken index or header
        return [f"cannot read {folder!r}: {err}"]
    match.reader.close()
    problems = []
    if match.missing:
        problems.append(f"{len(match.missing)} missing keys {match.missing[:5]}{' ...' * (len(match.missing) > 5)}")
    if match.unexpected:
        problems.append(f"{len(match.unexpected)} unexpected keys {match.unexpected[:5]}"
                        f"{' ...' * (len(match.unexpected) > 5)}")
    return problems + [f"shape mismatch {m}" for m in match.mismatches]


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str) -> None:
    """Load a HF-format checkpoint (``model.safetensors`` or shards + index) into ``model``.

    ``model`` may be plain or sharded by any plan (FSDP2 / TP / EP DTensors, a pipeline stage):
    each rank reads only the boxes its own shards hold. It must be materialised (not on the meta
    device). Raises ValueError listing every missing key, unexpected key and shape mismatch before
    anything is loaded.
    """
    match = _match(model, folder)
    meta = [n for n, (_, t) in match.targets.items() if t.device.type == "meta"]
    if meta:
        match.reader.close()
        raise ValueError(
            f"model has {len(meta)} tensors on the meta device (e.g. {meta[0]}): materialise it first "
            "with model.to_empty(device=...) and model.init_weights()"
        )
    if match.missing or match.unexpected:
        match.reader.close()
        raise ValueError(
            f"checkpoint {folder!r} does not match the model: {len(match.missing)} missing keys {match.missing}; "
            f"{len(match.unexpected)} unexpected keys {match.unexpected}"
        )
    if match.mismatches:
        match.reader.close()
        raise ValueError(f"shape mismatches loading {folder!r}: {match.mismatches}")
    reader = match.reader
    if reader.ignored_layers and (not dist.is_initialized() or dist.get_rank() == 0):
        layers = sorted(reader.ignored_layers, key=lambda n: int(n.rsplit(".", 1)[1]))
        logger.warning("%s: skipped %s (multi-token-prediction layers past num_hidden_layers=%d, which neither "
                       "transformers nor xorl builds)", folder, ", ".join(layers), model.spec.num_hidden_layers)
    order = {file: i for i, file in enumerate(reader.files)}
    try:  # file by file, so each file is opened about once
        for name in sorted(match.targets, key=lambda n: order[reader.file_of[match.recipes[n].sources[0]]]):
            raw, tensor = match.targets[name]
            if match.boxes[name].numel:  # a rank may hold no rows of a small tensor split over many
                match.recipes[name].fill(reader, local_tensor(tensor), match.boxes[name])
    finally:
        reader.close()
    if hasattr(model, "tie_weights") and not any(isinstance(t, DTensor) for _, t in match.targets.values()):
        model.tie_weights()

