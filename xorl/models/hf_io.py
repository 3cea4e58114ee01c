"""Hugging Face safetensors checkpoints <-> xorl models, from and to a local folder (no hub access).

Name / layout conversions (everything else keeps its name):
- MoE experts: HF files hold one Linear per expert, ``...mlp.experts.{j}.{gate,up,down}_proj.weight``
  [out, in]; xorl holds them stacked as ``...mlp.experts.gate_up_proj`` [E, H, 2I] (each expert's
  gate columns, then its up columns) and ``...mlp.experts.down_proj`` [E, I, H] ([E, in, out]).
  transformers v5's in-memory fused layout (``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I]) is also accepted when loading.
- merge_qkv: xorl's ``self_attn.qkv_proj`` rows are grouped by KV head (per group: its query heads,
  its key head, its value head; xorl/models/attention.py); HF files always hold ``q_proj`` /
  ``k_proj`` / ``v_proj``.
- merge_gate_up: the dense MLP's ``mlp.gate_up_proj`` rows alternate gate and up units (row 2i
  gate i, row 2i + 1 up i; xorl/models/layers.py); HF files hold ``gate_proj`` / ``up_proj``.
- tie_word_embeddings: ``lm_head.weight`` is not written (as in HF) and ignored when loading.
- gpt-oss (``Family.experts_interleaved``): HF files hold the experts stacked [E, in, out] with gate
  and up columns interleaved, with per-expert biases, in bf16 or MXFP4 blocks and scales
  (xorl/models/mxfp4.py reads them box by box, dequantising only the boxes a rank holds); export
  writes the dense interleaved layout.
- Block-quantised FP8 folders (DeepSeek-V3's release: ``X.weight`` float8 with ``X.weight_scale_inv``)
  are read dequantised, box by box (xorl/models/fp8_blocks.py); the scales are not sources of their own.
- A family's own spelling (``Family.weight_names``: Mixtral's ``block_sparse_moe.experts.{j}.w1``,
  GLM's ``mlp.shared_experts``) is applied last when writing and first when reading
  (``FileNames``); everything above works on the common names.

Parallel models: each rank loads only the boxes its DTensor shards (FSDP2 / TP / EP) hold, read
lazily from the files (``get_slice``), and a pipeline stage only its own layers; expert-parallel
MoE blocks that hold a plain slice of the experts (``local_expert_range``) get their slice.
``save_hf_weights`` gathers through ``full_tensor()`` (a collective: call it on every rank; only
rank 0 writes); xorl/export.py streams a large model from its DCP checkpoint instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from xorl.distributed.shard_box import ShardBox, local_tensor, parameter_box
from xorl.models import fp8_blocks
from xorl.models.param_names import clean_name
from xorl.models.registry import to_hf_config_dict
from xorl.models.spec import ModelSpec

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_TMP_PREFIX = ".xorl-shard-"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_STACKED_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp)\.gate_up_proj\.(?P<kind>weight|bias)$")
_QKV = re.compile(r"^(?P<prefix>.*\.self_attn)\.qkv_proj\.(?P<kind>weight|bias)$")


class FileNames:
    """A family's HF file names <-> the common names (Qwen / Llama spelling) the recipes use."""

    def __init__(self, spec: ModelSpec | None):
        family = spec.family if spec is not None else None
        pairs = family.weight_names if family is not None else ()
        self.ignore_layers_from = spec.num_hidden_layers if family is not None and family.ignore_extra_layers else None

        def rule(src: str, dst: str):
            pattern = re.compile(r"\." + re.escape(src).replace(re.escape("{j}"), r"(\d+)"))
            return pattern, "." + dst.replace("{j}", r"\1")

        self.to_file = [rule(a, b) for a, b in pairs]
        self.from_file = [rule(b, a) for a, b in pairs]

    @staticmethod
    def _apply(rules, name: str) -> str:
        for pattern, repl in rules:
            name, count = pattern.subn(repl, name, count=1)
            if count:
                break
        return name

    def file_name(self, name: str) -> str:
        return self._apply(self.to_file, name)

    def common_name(self, name: str) -> str:
        return self._apply(self.from_file, name)

    def ignored(self, name: str) -> bool:
        """Layers past num_hidden_layers that the family's files hold but the model never builds."""
        if self.ignore_layers_from is None or not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) >= self.ignore_layers_from


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
#
# Each rank reads only the box of each checkpoint tensor that its own shards need (safetensors'
# lazy ``get_slice``), converted to xorl's layout on the way: a rank never holds a full copy of
# the model, and at most one expert's or one projection's box of it beyond its own shards.


class _Recipe:
    """How one xorl tensor is made from checkpoint tensors: its global shape, and any box of it."""

    def __init__(self, sources: list[str]):
        self.sources = sources

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        raise NotImplementedError

    def fill(self, read: _SliceReader, dest: torch.Tensor, box: ShardBox) -> None:
        raise NotImplementedError


class _Identity(_Recipe):
    def shape(self, shapes):
        return shapes[self.sources[0]]

    def fill(self, read, dest, box):
        dest.copy_(read(self.sources[0], box.slices))


class _GroupedQKV(_Recipe):
    """merge_qkv: ``qkv_proj`` rows in KV-head groups [q heads of group g; k_g; v_g] from HF's q/k/v.
    A box (a TP rank's whole groups, an FSDP row range) reads only the head rows it covers."""

    def __init__(self, sources: list[str], q_per_group: int, head_dim: int):
        super().__init__(sources)
        self.q_per_group, self.head_dim = q_per_group, head_dim

    def shape(self, shapes):
        parts = [shapes[s] for s in self.sources]
        return (sum(p[0] for p in parts), *parts[0][1:])

    def _source_row(self, segment: int) -> tuple[str, int]:
        """The HF tensor and first row of the ``segment``-th head (head_dim rows) of qkv_proj."""
        group, i = divmod(segment, self.q_per_group + 2)
        if i < self.q_per_group:
            return self.sources[0], (group * self.q_per_group + i) * self.head_dim
        return self.sources[1 if i == self.q_per_group else 2], group * self.head_dim

    def fill(self, read, dest, box):
        first, last = box.offset[0], box.offset[0] + box.shape[0]
        hd = self.head_dim
        for segment in range(first // hd, (last - 1) // hd + 1):
            lo, hi = max(first, segment * hd), min(last, (segment + 1) * hd)
            source, row = self._source_row(segment)
            start = row + lo - segment * hd
            dest[lo - first:hi - first].copy_(read(source, (slice(start, start + hi - lo), *box.slices[1:])))


class _InterleavedRows(_Recipe):
    """merge_gate_up: ``gate_up_proj`` rows [g_0, u_0, g_1, u_1, ...] from HF's gate and up; a box
    reads only the gate and up rows it covers."""

    def shape(self, shapes):
        gate = shapes[self.sources[0]]
        return (2 * gate[0], *gate[1:])

    def fill(self, read, dest, box):
        first, last = box.offset[0], box.offset[0] + box.shape[0]
        rest = box.slices[1:]
        for source, parity in zip(self.sources, (0, 1)):  # rows 2i + parity hold unit i of the source
            lo, hi = (first - parity + 1) // 2, (last - parity + 1) // 2
            if lo < hi:
                dest[2 * lo + parity - first::2].copy_(read(source, (slice(lo, hi), *rest)))


class _StackTransposed(_Recipe):
    """Per-expert HF Linears [out, in] -> stacked [E, in, out]; a box reads only its experts."""

    def shape(self, shapes):
        out_features, in_features = shapes[self.sources[0]]
        return (len(self.sources), in_features, out_features)

    def fill(self, read, dest, box):
        experts, rows, cols = box.slices
        for j in range(experts.start, experts.stop):
            dest[j - experts.start].copy_(read(self.sources[j], (cols, rows)).t())


class _StackGateUp(_Recipe):
    """Per-expert HF gate and up Linears [I, H] -> stacked ``gate_up_proj`` [E, H, 2I]; a box reads
    only its experts, and of each only the gate and / or up columns it covers."""

    def __init__(self, gates: list[str], ups: list[str]):
        super().__init__([*gates, *ups])
        self.gates, self.ups = gates, ups

    def shape(self, shapes):
        inter, hidden = shapes[self.gates[0]]
        return (len(self.gates), hidden, 2 * inter)

    def fill(self, read, dest, box):
        experts, rows, cols = box.slices
        inter = read.shape(self.gates[0])[0]
        for j in range(experts.start, experts.stop):
            for sources, shift in ((self.gates, 0), (self.ups, inter)):
                lo, hi = max(cols.start, shift), min(cols.stop, shift + inter)
                if lo < hi:
                    part = read(sources[j], (slice(lo - shift, hi - shift), rows)).t()
                    dest[j - experts.start, :, lo - cols.start:hi - cols.start].copy_(part)


class _Transposed12(_Recipe):
    """transformers v5 ``down_proj`` [E, H, I] -> [E, I, H], ``gate_up_proj`` [E, 2I, H] -> [E, H, 2I]."""

    def shape(self, shapes):
        experts, hidden, inter = shapes[self.sources[0]]
        return (experts, inter, hidden)

    def fill(self, read, dest, box):
        experts, inter, hidden = box.slices
        dest.copy_(read(self.sources[0], (experts, hidden, inter)).transpose(1, 2))


def _per_expert(prefix: str, proj: str, sources: set[str], count: int = 0) -> list[str]:
    """``{prefix}.{j}.{proj}.weight`` for j up to the highest index present (at least ``count``):
    listing every index makes a gap show up as a missing key."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.{proj}\.weight$")
    top = max((int(m[1]) for s in sources if (m := pattern.match(s))), default=0)
    return [f"{prefix}.{j}.{proj}.weight" for j in range(max(top + 1, count))]


def _plan(targets: list[str], sources: set[str], tied: bool, spec: ModelSpec | None = None) -> dict[str, _Recipe]:
    """One recipe per target name, decided from the names alone (before reading any data); ``spec``
    gives merge_qkv's head grouping."""
    from xorl.models import mxfp4

    interleaved = spec is not None and spec.family.experts_interleaved
    recipes: dict[str, _Recipe] = {}
    for name in targets:
        if interleaved and (gpt_oss := mxfp4.EXPERT_TENSOR.match(name)):
            recipes[name] = mxfp4.ExpertRecipe(gpt_oss["prefix"], gpt_oss["proj"], bool(gpt_oss["bias"]), sources)
            continue
        qkv = _QKV.match(name)
        expert = _STACKED_EXPERT.match(name)
        gate_up = _GATE_UP.match(name)
        if tied and name == "lm_head.weight":  # HF files do not hold a tied head: it is the embedding
            recipes[name] = _Identity(["model.embed_tokens.weight"])
        elif qkv:
            p, kind = qkv["prefix"], qkv["kind"]
            if spec is None:
                raise ValueError(f"{name}: loading a merged qkv_proj needs the model's spec (its head counts)")
            recipes[name] = _GroupedQKV([f"{p}.{x}_proj.{kind}" for x in "qkv"],
                                        spec.num_attention_heads // spec.num_key_value_heads, spec.head_dim)
        elif gate_up:
            p, kind = gate_up["prefix"], gate_up["kind"]
            recipes[name] = _InterleavedRows([f"{p}.gate_proj.{kind}", f"{p}.up_proj.{kind}"])
        elif expert and f"{expert['prefix']}.gate_up_proj" in sources:  # transformers v5 fused layout
            recipes[name] = _Transposed12([f"{expert['prefix']}.{expert['proj']}"])
        elif expert and f"{expert['prefix']}.0.down_proj.weight" in sources:  # per-expert Linears
            p = expert["prefix"]
            if expert["proj"] == "down_proj":
                recipes[name] = _StackTransposed(_per_expert(p, "down_proj", sources))
            else:
                n = max(len(_per_expert(p, "gate_proj", sources)), len(_per_expert(p, "up_proj", sources)))
                recipes[name] = _StackGateUp(_per_expert(p, "gate_proj", sources, n),
                                             _per_expert(p, "up_proj", sources, n))
        else:
            recipes[name] = _Identity([name])
    return recipes


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


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor.detach()


def hf_pieces(name: str, shape: tuple[int, ...], spec: ModelSpec) -> list[tuple[str, Callable]]:
    """The HF tensors that xorl tensor ``name`` (of global ``shape``) becomes: (HF name, function
    from the xorl tensor to that HF tensor, a view). Empty for a tied lm_head. Decided from the
    name and shape alone, so an export can plan its files before reading any data."""
    names = FileNames(spec)
    return [(names.file_name(hf_name), take) for hf_name, take in _common_pieces(name, shape, spec)]


def _common_pieces(name: str, shape: tuple[int, ...], spec: ModelSpec) -> list[tuple[str, Callable]]:
    from xorl.nn.lora import is_adapter_name

    # A LoRA adapter is not part of the base model's folder (xorl/lora_io.py writes it in peft's
    # format; an export merges it into the base weight, xorl/export.py).
    if (spec.tie_word_embeddings and name == "lm_head.weight") or is_adapter_name(name):
        return []
    if spec.family.experts_interleaved:
        from xorl.models.mxfp4 import EXPERT_TENSOR, interleave_gate_up

        if (gpt_oss := EXPERT_TENSOR.match(name)) and gpt_oss["proj"] == "gate_up_proj":
            return [(name, interleave_gate_up)]
        if gpt_oss:
            return [(name, lambda t: t)]
    qkv = _QKV.match(name)
    expert = _STACKED_EXPERT.match(name)
    gate_up = _GATE_UP.match(name)
    if gate_up:  # rows alternate gate and up
        return [(f"{gate_up['prefix']}.{x}_proj.{gate_up['kind']}", lambda t, s=s: t[s::2])
                for x, s in (("gate", 0), ("up", 1))]
    if qkv:
        groups, hd = spec.num_key_value_heads, spec.head_dim
        per = spec.num_attention_heads // groups  # query heads per KV group
        if shape[0] != groups * (per + 2) * hd:
            raise ValueError(
                f"{name} has {shape[0]} rows, expected q+k+v = {groups * (per + 2) * hd}: "
                "save the full tensor (gather a tensor-parallel one with full_tensor())"
            )

        def part(t: torch.Tensor, heads: slice) -> torch.Tensor:  # KV-head groups -> HF's [heads * hd, ...]
            blocks = t.view(groups, per + 2, hd, *t.shape[1:])[:, heads]
            return blocks.reshape(-1, *t.shape[1:])

        parts = {"q": slice(0, per), "k": slice(per, per + 1), "v": slice(per + 1, per + 2)}
        return [(f"{qkv['prefix']}.{x}_proj.{qkv['kind']}", lambda t, s=s: part(t, s)) for x, s in parts.items()]
    if expert:
        if shape[0] != spec.num_experts:
            raise ValueError(
                f"{name} holds {shape[0]} experts, the model has {spec.num_experts}: gather the "
                "expert-parallel slices into full tensors before saving"
            )
        p = expert["prefix"]
        if expert["proj"] == "down_proj":
            return [(f"{p}.{j}.down_proj.weight", lambda t, j=j: t[j].t()) for j in range(shape[0])]
        inter = shape[2] // 2  # gate_up_proj [E, H, 2I]: gate columns, then up
        return [piece for j in range(shape[0]) for piece in (
            (f"{p}.{j}.gate_proj.weight", lambda t, j=j: t[j, :, :inter].t()),
            (f"{p}.{j}.up_proj.weight", lambda t, j=j: t[j, :, inter:].t()))]
    return [(name, lambda t: t)]


def iter_hf_tensors(
    state_dict: dict[str, torch.Tensor], spec: ModelSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of an xorl state dict, in its order."""
    for raw, tensor in state_dict.items():
        name = clean_name(raw)
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensor = _full(tensor)
        for hf_name, take in hf_pieces(name, tuple(tensor.shape), spec):
            yield hf_name, take(tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def save_hf_weights(
    model_or_state_dict: nn.Module | dict[str, torch.Tensor],
    folder: str,
    model_config: Any,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> None:
    """Write HF-style ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + index) and
    config.json into ``folder``; transformers' ``from_pretrained(folder)`` loads the result.

    dtype: cast floating-point tensors before writing (None keeps the model's dtypes).
    Files of a previous save with the same names are replaced. With DTensor parameters every rank
    must call this (``full_tensor()`` is a collective); only rank 0 writes.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    spec = ModelSpec.from_config(model_config)
    if isinstance(model_or_state_dict, nn.Module):
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = model_or_state_dict
    writer = not dist.is_initialized() or dist.get_rank() == 0
    if writer:
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):
            if old in (SINGLE_NAME, INDEX_NAME) or _SHARD_NAME.match(old) or old.startswith(_TMP_PREFIX):
                os.remove(os.path.join(folder, old))

    # Stream: a shard is written as soon as it is full, so at most one shard is held in memory.
    # Shards get temporary names until their total count is known.
    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_size = 0
    saved_dtype = None

    def flush():
        tmp = f"{_TMP_PREFIX}{len(written)}.safetensors"
        save_file(shard, os.path.join(folder, tmp), metadata={"format": "pt"})
        written.append((tmp, list(shard)))

    for name, tensor in iter_hf_tensors(state_dict, spec):
        if not writer:
            continue  # iter_hf_tensors still runs: full_tensor() is a collective
        tensor = tensor.to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if saved_dtype is None and tensor.is_floating_point():
            saved_dtype = tensor.dtype
        # safetensors wants dense tensors that share no storage (q/k/v splits, expert slices are views).
        tensor = tensor.contiguous()
        if tensor.untyped_storage().nbytes() != _nbytes(tensor):
            tensor = tensor.clone()
        size = _nbytes(tensor)
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += size
        total_size += size
    if not writer:
        return
    flush()

    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        file = SINGLE_NAME if len(written) == 1 else f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(os.path.join(folder, tmp), os.path.join(folder, file))
        weight_map.update({name: file for name in names})
    if len(written) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(folder, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(to_hf_config_dict(spec, dtype=saved_dtype), f, indent=2)
