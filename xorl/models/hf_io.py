"""Hugging Face safetensors checkpoints <-> xorl models, from and to a local folder (no hub access).

Name / layout conversions (everything else keeps its name):
- MoE experts: HF files hold one Linear per expert, ``...mlp.experts.{j}.{gate,up,down}_proj.weight``
  [out, in]; xorl holds them stacked as ``...mlp.experts.{gate,up,down}_proj`` [E, in, out].
  transformers v5's in-memory fused layout (``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I]) is also accepted when loading.
- merge_qkv: xorl's ``self_attn.qkv_proj`` is [q; k; v] along the output dim; HF files always hold
  ``q_proj`` / ``k_proj`` / ``v_proj``.
- tie_word_embeddings: ``lm_head.weight`` is not written (as in HF) and ignored when loading.

Parallel models: DTensor parameters (FSDP2 / TP) are loaded by distributing the full tensor and
saved through ``full_tensor()`` (a collective: call save on every rank; only rank 0 writes).
Expert-parallel MoE blocks that hold a slice of the experts (``local_expert_range``) get their slice.
"""

from __future__ import annotations

import inspect
import json
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

from xorl.models.registry import to_hf_config_dict
from xorl.models.spec import ModelSpec

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_TMP_PREFIX = ".xorl-shard-"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# Wrappers (activation checkpointing, torch.compile, FSDP1) insert these into parameter names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_STACKED_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_QKV = re.compile(r"^(?P<prefix>.*\.self_attn)\.qkv_proj\.(?P<kind>weight|bias)$")


def clean_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


@dataclass
class _Recipe:
    """How one xorl tensor is made from HF tensors."""

    sources: list[str]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]


def _identity(tensors):
    return tensors[0]


def _concat_rows(tensors):
    return torch.cat(tensors, dim=0)


def _stack_transposed(tensors):
    return torch.stack([t.t() for t in tensors])


def _plan(targets: list[str], sources: set[str]) -> dict[str, _Recipe]:
    """One recipe per target name, decided from the names alone (before reading any data)."""
    recipes = {}
    for name in targets:
        qkv = _QKV.match(name)
        expert = _STACKED_EXPERT.match(name)
        if qkv:
            p, kind = qkv["prefix"], qkv["kind"]
            recipes[name] = _Recipe([f"{p}.{x}_proj.{kind}" for x in "qkv"], _concat_rows)
        elif expert and f"{expert['prefix']}.gate_up_proj" in sources:  # transformers v5 fused layout
            p, proj = expert["prefix"], expert["proj"]
            if proj == "down_proj":
                recipes[name] = _Recipe([f"{p}.down_proj"], lambda t: t[0].transpose(1, 2))
            else:
                first = proj == "gate_proj"
                recipes[name] = _Recipe([f"{p}.gate_up_proj"], lambda t, first=first: _half(t[0], first))
        elif expert and f"{expert['prefix']}.0.{expert['proj']}.weight" in sources:  # per-expert Linears
            p, proj = expert["prefix"], expert["proj"]
            pattern = re.compile(rf"^{re.escape(p)}\.(\d+)\.{proj}\.weight$")
            top = max(int(m[1]) for s in sources if (m := pattern.match(s)))
            # Listing up to the highest index makes a gap show up as a missing key.
            recipes[name] = _Recipe([f"{p}.{j}.{proj}.weight" for j in range(top + 1)], _stack_transposed)
        else:
            recipes[name] = _Recipe([name], _identity)
    return recipes


def _half(gate_up: torch.Tensor, first: bool) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    part = gate_up[:, :inter] if first else gate_up[:, inter:]
    return part.transpose(1, 2)


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


def _load_targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """clean name -> parameter / persistent buffer, and clean name -> name in ``model``."""
    targets, raw_names = {}, {}
    tied = bool(getattr(getattr(model, "spec", None), "tie_word_embeddings", False))
    for raw, tensor in model.state_dict(keep_vars=True).items():
        name = clean_name(raw)
        if tied and name == "lm_head.weight":
            continue
        targets[name] = tensor
        raw_names[name] = raw
    return targets, raw_names


def _fit_to_target(model: nn.Module, raw_name: str, full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Slice this rank's experts out of a full [E, ...] tensor for an expert-parallel MoE block."""
    if full.shape == target.shape or not _STACKED_EXPERT.match(clean_name(raw_name)):
        return full
    owner = model.get_submodule(raw_name.rsplit(".", 2)[0])  # "...mlp.experts.gate_proj" -> "...mlp"
    expert_range = getattr(owner, "local_expert_range", None)
    if expert_range is not None and full.shape[1:] == target.shape[1:]:
        first, last = expert_range
        return full[first:last]
    return full


def _load_one(model: nn.Module, raw_name: str, full: torch.Tensor, target: torch.Tensor) -> str | None:
    """Copy ``full`` (or this rank's expert slice of it) into ``target``; an error string on mismatch."""
    value = _fit_to_target(model, raw_name, full, target)
    if tuple(value.shape) != tuple(target.shape):
        return f"checkpoint {tuple(full.shape)} vs model {tuple(target.shape)}"
    _copy_into(target, value)
    return None


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        kwargs = {}
        if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
            kwargs["src_data_rank"] = None  # every rank read the same file: no broadcast needed
        value = value.to(device=target.device, dtype=target.dtype)
        local = distribute_tensor(value, target.device_mesh, target.placements, **kwargs).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(value)


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str) -> None:
    """Load a HF-format checkpoint (``model.safetensors`` or shards + index) into ``model``.

    The model must be materialised (not on the meta device). Raises ValueError listing every
    missing key, unexpected key and shape mismatch; nothing is loaded partially silently.
    """
    files = _checkpoint_files(folder)
    source_files: dict[str, str] = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in f.keys():
                source_files[key] = file
    targets, raw_names = _load_targets(model)
    meta = [n for n, t in targets.items() if t.device.type == "meta"]
    if meta:
        raise ValueError(
            f"model has {len(meta)} tensors on the meta device (e.g. {meta[0]}): materialise it first "
            "with model.to_empty(device=...) and model.init_weights()"
        )
    recipes = _plan(list(targets), set(source_files))
    used = {s for r in recipes.values() for s in r.sources}
    missing = sorted({s for r in recipes.values() for s in r.sources if s not in source_files})
    ignored = {"lm_head.weight"} if "lm_head.weight" not in targets else set()
    unexpected = sorted(set(source_files) - used - ignored)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder!r} does not match the model: {len(missing)} missing keys {missing}; "
            f"{len(unexpected)} unexpected keys {unexpected}"
        )

    waiting = {name: set(r.sources) for name, r in recipes.items()}
    by_source: dict[str, list[str]] = {}
    for name, r in recipes.items():
        for s in r.sources:
            by_source.setdefault(s, []).append(name)
    pending: dict[str, torch.Tensor] = {}  # read, but some recipe using it still waits for more
    mismatches: list[str] = []
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in f.keys():
                if key not in used:
                    continue
                pending[key] = f.get_tensor(key)
                for name in by_source[key]:
                    waiting[name].discard(key)
                    if not waiting[name]:
                        recipe = recipes[name]
                        full = recipe.combine([pending[s] for s in recipe.sources])
                        error = _load_one(model, raw_names[name], full, targets[name])
                        if error:
                            mismatches.append(f"{name}: {error}")
                # Experts of one layer can span shard files: keep a source until its recipes ran.
                for s in [s for s in pending if all(not waiting[n] for n in by_source[s])]:
                    del pending[s]
    if mismatches:
        raise ValueError(f"shape mismatches loading {folder!r}: {mismatches}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor.detach()


def iter_hf_tensors(
    state_dict: dict[str, torch.Tensor], spec: ModelSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of an xorl state dict, in its order."""
    q_size = spec.num_attention_heads * spec.head_dim
    kv_size = spec.num_key_value_heads * spec.head_dim
    for raw, tensor in state_dict.items():
        name = clean_name(raw)
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensor = _full(tensor)
        qkv = _QKV.match(name)
        expert = _STACKED_EXPERT.match(name)
        if qkv:
            if tensor.shape[0] != q_size + 2 * kv_size:
                raise ValueError(
                    f"{name} has {tensor.shape[0]} rows, expected q+k+v = {q_size + 2 * kv_size}: "
                    "save the unsharded model (merge_qkv models cannot be tensor-parallel)"
                )
            for part, value in zip("qkv", tensor.split([q_size, kv_size, kv_size], dim=0)):
                yield f"{qkv['prefix']}.{part}_proj.{qkv['kind']}", value
        elif expert:
            if tensor.shape[0] != spec.num_experts:
                raise ValueError(
                    f"{name} holds {tensor.shape[0]} experts, the model has {spec.num_experts}: gather the "
                    "expert-parallel slices into full tensors before saving"
                )
            for j in range(tensor.shape[0]):
                yield f"{expert['prefix']}.{j}.{expert['proj']}.weight", tensor[j].t()
        else:
            yield name, tensor


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
