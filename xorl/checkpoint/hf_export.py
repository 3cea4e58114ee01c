"""Export to a Hugging Face safetensors folder, streamed from a DCP checkpoint.

Two callers: the trainer at the end of a run (``export_hf: true``; every rank converts some of
the output files, from the final step's checkpoint) and ``xorl-export CHECKPOINT_DIR OUT_DIR``
(one process: no GPU, no process group of the training size).

Why from the checkpoint: it already holds every tensor once, under the full model's names, with
its global shape (FSDP / TP / EP / PP shards are chunks of it), so a converter reads one whole
tensor at a time from all ranks' files, writes its HF pieces, and drops it before the next. Peak
host memory is one xorl tensor (the embedding, one layer's stacked experts), not the model.

Why files are streamed: the plan knows every HF name, shape and dtype before any data is read, so
each ``.safetensors`` file is written header first, then one tensor's bytes after another; no
file is ever built in memory. Files, index and names are those transformers writes
(``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``).

Why atomic: everything is written into ``OUT_DIR.partial``; the index and config.json come last,
then the folder is renamed to ``OUT_DIR``. A crash leaves no folder named ``OUT_DIR`` that is
not complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from xorl.models.hf_layout import INDEX_NAME, SINGLE_NAME, hf_pieces
from xorl.models.param_names import clean_name
from xorl.models.registry import build_model, to_hf_config_dict
from xorl.models.spec import ModelSpec
from xorl.observability.memory_report import (
    current_host_bytes,
    gather_rank_figures,
    memory_summary,
    peak_host_bytes,
    reset_peak_host_bytes,
    write_json_atomic,
)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers v4's default max_shard_size ("5GB")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF folder: made by ``take`` from the checkpoint tensor ``source``."""

    name: str
    source: str
    take: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


def plan_hf_tensors(metadata: Metadata, model_config: Any, dtype: torch.dtype | None = None) -> list[HFTensor]:
    """The HF tensors of a checkpoint, in the model's order, from its metadata alone (no data read).

    ``dtype`` casts floating-point tensors (None keeps the checkpoint's, fp32 master weights).
    """
    spec = ModelSpec.from_config(model_config)
    with torch.device("meta"):
        names = [clean_name(k) for k in build_model(model_config).state_dict()]
    stored = {clean_name(k.removeprefix("model.")): (k, md) for k, md in metadata.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    tied = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    missing = [n for n in names if n not in stored and n not in tied]
    unexpected = sorted(set(stored) - set(names))
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint does not hold the model its config describes: {len(missing)} missing tensors "
            f"{missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}"
        )
    out = []
    for name in dict.fromkeys(names):  # a tied lm_head is listed twice; hf_pieces drops it anyway
        if name not in stored:
            continue
        key, md = stored[name]
        shape = tuple(md.size)
        for hf_name, take in hf_pieces(name, shape, spec):
            piece_shape = tuple(take(torch.empty(shape, device="meta")).shape)
            piece_dtype = dtype if dtype is not None and md.properties.dtype.is_floating_point else md.properties.dtype
            out.append(HFTensor(hf_name, key, take, piece_shape, piece_dtype))
    return out


def split_into_files(tensors: list[HFTensor], max_shard_bytes: int) -> list[list[HFTensor]]:
    """transformers' rule (huggingface_hub's split_torch_state_dict_into_shards): fill a file in
    order until the next tensor would pass the limit; a tensor above the limit gets a file of its own."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    files, current, size = [], [], 0
    for tensor in tensors:
        if tensor.nbytes > max_shard_bytes:
            files.append([tensor])
            continue
        if current and size + tensor.nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class _MetadataOnce(FileSystemReader):
    """Reads the checkpoint's metadata file once (DCP reads it again on every load otherwise)."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def lora_merges(metadata: Metadata, model_config: Any) -> dict[str, tuple[str, str, float]]:
    """checkpoint key of a LoRA-adapted base weight -> (its lora_A key, lora_B key, scaling); {} without LoRA.

    Why the export merges (W + scaling * B A, peft's ``merge_and_unload``): the HF folder is then the
    fine-tuned model that transformers loads with no peft installed; the adapter alone is in the run
    folder (output_dir/adapter, xorl/checkpoint/peft_adapter.py) for peft users."""
    lora = getattr(model_config, "lora", None)
    if not lora:
        return {}
    from xorl.nn.lora import lora_spec

    merges = {}
    for key in metadata.state_dict_metadata:
        if key.endswith(".lora_A"):
            module = key.removesuffix(".lora_A")
            parent, _, leaf = module.rpartition(".")
            if leaf in ("lora_gate_up_proj", "lora_down_proj"):  # experts.lora_X adapts experts.X [E, in, out]
                base, spec = f"{parent}.{leaf.removeprefix('lora_')}", lora_spec(lora, "experts")
            else:
                base, spec = module + ".weight", lora_spec(lora, leaf)
            merges[base] = (key, module + ".lora_B", spec.scaling)
    return merges


class CheckpointTensors:
    """Whole tensors of a DCP checkpoint, read one at a time; the last one is kept for its next pieces.

    With a LoRA ``model_config`` the adapted base weights are returned with their adapter merged in
    (``lora_merges``)."""

    def __init__(self, path: str, model_config: Any = None):
        self.reader = _MetadataOnce(path)
        self.metadata = self.reader.read_metadata()
        self.merges = lora_merges(self.metadata, model_config) if model_config is not None else {}
        self._key: str | None = None
        self._tensor: torch.Tensor | None = None

    def _load(self, key: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        with warnings.catch_warnings():  # "no process group: loading in one process" is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: tensor}, storage_reader=self.reader, no_dist=True)
        return tensor

    def get(self, key: str) -> torch.Tensor:
        if key != self._key:
            self._key, self._tensor = None, None  # freed before the next one is allocated
            tensor = self._load(key)
            if key in self.merges:
                from xorl.nn.lora import merged_weight

                a_key, b_key, scaling = self.merges[key]
                tensor = merged_weight(tensor, self._load(a_key), self._load(b_key), scaling)
            self._key, self._tensor = key, tensor
        return self._tensor


def write_safetensors(path: str, tensors: list[HFTensor], source: CheckpointTensors) -> None:
    """One safetensors file, streamed: the header (names, dtypes, shapes, offsets), then each tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            value = t.take(source.get(t.source)).to(t.dtype).contiguous()
            f.write(value.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _swap_into_place(partial: str, folder: str) -> None:
    """``partial`` becomes ``folder``; a previous export there is moved aside first, removed after."""
    old = folder + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(folder):
        os.rename(folder, old)
    os.rename(partial, folder)
    shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint: str, folder: str, model_config: Any, *,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None,
                      device: torch.device | None = None, output_dir: str | None = None,
                      host_before: int | None = None, report_path: str | None = None) -> dict:
    """Convert the DCP checkpoint ``checkpoint`` into the HF folder ``folder`` (replaced if present).

    Collective when a process group is up: rank r writes files r, r + world, ...; rank 0 writes the
    index and config.json and moves the folder into place. Returns the per-rank memory figures,
    also written to ``report_path`` or else ``output_dir/export.json`` when either is given.
    ``host_before``: the resident bytes before the caller's export began (it reset the peak then);
    None: measured here.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    started = time.perf_counter()
    source = CheckpointTensors(checkpoint, model_config)
    files = split_into_files(plan_hf_tensors(source.metadata, model_config, dtype), max_shard_bytes)
    names = file_names(len(files))
    if host_before is None:
        # Taken after the plan: planning builds the model on the meta device, which imports the
        # model code (Triton alone is ~120 MB resident), a constant of the process, not of the model;
        # the plan itself is names and shapes. The peak below is the export's own.
        host_before = current_host_bytes()
        reset_peak_host_bytes()
    folder = os.path.normpath(folder)
    partial = folder + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    for i in range(rank, len(files), world):
        write_safetensors(os.path.join(partial, names[i]), files[i], source)
    del source
    _barrier()
    if rank == 0:
        _write_index_and_config(partial, files, names, model_config)
        _swap_into_place(partial, folder)
    _barrier()
    figures = {"peak_host_bytes": peak_host_bytes(), "host_bytes_before": host_before,
               "seconds": time.perf_counter() - started}
    ranks = gather_rank_figures(figures, device or torch.device("cpu"))
    model_bytes = 4 * sum(t.nbytes // t.dtype.itemsize for f in files for t in f)
    report = {"checkpoint": checkpoint, "folder": folder, "files": len(files), "model_bytes": model_bytes,
              "ranks": ranks}
    if rank == 0:
        if output_dir is not None or report_path is not None:
            write_json_atomic(report_path or os.path.join(output_dir, "export.json"), report)
        print(memory_summary("export", ranks, model_bytes) + f"; {folder}", flush=True)
    return report


def _write_index_and_config(partial: str, files: list[list[HFTensor]], names: list[str], model_config) -> None:
    tensors = [t for f in files for t in f]
    if len(files) > 1:
        weight_map = {t.name: name for f, name in zip(files, names) for t in f}
        index = {"metadata": {"total_parameters": sum(t.nbytes // t.dtype.itemsize for t in tensors),
                              "total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": weight_map}
        with open(os.path.join(partial, INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as transformers writes it
    saved_dtype = next((t.dtype for t in tensors if t.dtype.is_floating_point), None)
    with open(os.path.join(partial, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_hf_config_dict(model_config, dtype=saved_dtype), f, indent=2)
    if getattr(model_config, "model_path", None):  # the tokenizer and token ids travel with the model
        from xorl.models.pretrained import copy_tokenizer_and_ids

        copy_tokenizer_and_ids(model_config.model_path, partial)


def full_state_dict(parts, pp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective). For tests and tiny models only: it holds
    the whole model on every rank (export a large one with ``export_checkpoint``).

    FSDP, TP and EP shards are DTensors, which the state-dict helper gathers (experts to their
    global [E, ...] shape); pipeline stages keep the full model's names, so their dicts are merged
    across the pipeline group.
    """
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        state.update({k: v.detach().cpu() for k, v in full.items()})
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        gathered: list[dict] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, state, group=pp_group)
        for other in gathered:
            state.update(other)
    return state
