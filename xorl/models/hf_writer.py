"""xorl models -> Hugging Face safetensors checkpoints in a local folder: ``save_hf_weights``
(the names and layouts it writes: xorl/models/hf_layout.py's ``hf_pieces``). It gathers through
``full_tensor()`` (a collective: call it on every rank; only rank 0 writes); xorl/checkpoint/hf_export.py streams a
large model from its DCP checkpoint instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from xorl.models.hf_layout import INDEX_NAME, SINGLE_NAME, hf_pieces
from xorl.models.param_names import clean_name
from xorl.models.registry import to_hf_config_dict
from xorl.models.spec import ModelSpec

_TMP_PREFIX = ".xorl-shard-"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor.detach()



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
