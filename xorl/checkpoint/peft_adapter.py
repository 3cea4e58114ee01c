"""The LoRA adapter in peft's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

    save_adapter(trainer.parts, config.model, "outputs/adapter", pp_group)   # every rank calls it
    peft.PeftModel.from_pretrained(transformers_model, "outputs/adapter")    # xorl's logits

Keys are peft's: xorl's ``<module path>.lora_A`` [r, in] / ``.lora_B`` [out, r] are written as
``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight`` (peft drops the adapter name
"default" when it saves). The module paths are transformers' (xorl's models keep HF names).

Gathered from the shards without gathering the base: each adapter tensor is made whole from its
FSDP / TP shards (a collective over its own mesh, in the same order on every rank of that mesh),
and the pipeline stages' dicts are merged over the pipeline group. The adapter is rank x (in + out)
per projection, a few MB even on a 70B model, so every rank holding it briefly is harmless.
Rank 0 writes the folder atomically (``.partial``, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xorl.checkpoint.hf_export import _swap_into_place
from xorl.models.param_names import clean_name
from xorl.nn.lora import is_adapter_name
from xorl.run.folder import ADAPTER_DIR  # noqa: F401 - in the run folder: the adapter of the latest checkpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


# peft adapts transformers' stacked experts as parameters (``target_parameters``), one wrapper per
# parameter, nested in this order: the first listed is the inner one (``experts.base_layer``).
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_EXPERT_WRAPPER = {"lora_gate_up_proj": "base_layer.", "lora_down_proj": ""}


def peft_key(name: str) -> str:
    """xorl's ``model.layers.0.self_attn.q_proj.lora_A`` -> peft's
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the experts' adapters
    ``...mlp.experts.lora_gate_up_proj.lora_A`` -> ``...mlp.experts.base_layer.lora_A.weight``
    (``lora_down_proj``: ``...mlp.experts.lora_A.weight``)."""
    module, _, leaf = clean_name(name).rpartition(".")
    parent, _, owner = module.rpartition(".")
    if owner in _EXPERT_WRAPPER:
        return f"{PEFT_PREFIX}{parent}.{_EXPERT_WRAPPER[owner]}{leaf}.weight"
    return f"{PEFT_PREFIX}{module}.{leaf}.weight"


def peft_tensor(name: str, full: torch.Tensor) -> torch.Tensor:
    """The adapter tensor in peft's layout. Experts: xorl's A [E, in, r] / B [E, r, out] (grouped-GEMM
    layout) -> peft's ``lora_A.weight`` [E * r, in] (rows expert-major) / ``lora_B.weight`` [out, r * E]
    (columns rank-major: peft reshapes it to [out, r, E])."""
    if full.dim() != 3:
        return full
    if name.endswith("lora_A"):
        return full.transpose(1, 2).reshape(-1, full.shape[1])
    return full.permute(2, 1, 0).reshape(full.shape[2], -1)


def adapter_state_dict(parts: list[nn.Module], pp_group=None) -> dict[str, torch.Tensor]:
    """Every adapter tensor whole (peft's keys, fp32 on CPU), on every rank: a collective."""
    state = {}
    for part in parts:
        for name, param in part.named_parameters():
            if not is_adapter_name(name):
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            state[peft_key(name)] = peft_tensor(name, full.detach().to("cpu", torch.float32)).contiguous()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        gathered: list[dict] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, state, group=pp_group)
        for other in gathered:
            state.update(other)
    return state


def adapter_config(lora: dict, model_path: str | None) -> dict:
    """peft's LoraConfig fields for ``model.lora`` (what ``PeftConfig.from_pretrained`` reads)."""
    rank = int(lora["rank"])
    experts = "experts" in lora["target_modules"]
    if model_path and os.path.isdir(model_path):  # peft's AutoPeftModel loads the base from here, from any cwd
        model_path = os.path.abspath(model_path)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_path,
        "r": rank, "lora_alpha": float(lora.get("alpha", rank)), "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(set(lora["target_modules"]) - {"experts"}),
        "target_parameters": list(EXPERT_PARAMETERS) if experts else None, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": bool(lora.get("init_lora_weights", True)), "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "inference_mode": True,
    }


def save_adapter(parts: list[nn.Module], model_config, folder: str, pp_group=None) -> None:
    """Write the adapter of ``parts`` to ``folder`` in peft's format (collective; rank 0 writes)."""
    state = adapter_state_dict(parts, pp_group)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    write_adapter(state, model_config, folder)


def export_adapter(checkpoint: str, folder: str, model_config) -> int:
    """The adapter of a DCP checkpoint (any step, not only the run's latest in output_dir/adapter) in peft's
    format, one process, tensor by tensor (``xorl-export --adapter``); returns how many tensors."""
    from xorl.checkpoint.hf_export import CheckpointTensors

    source = CheckpointTensors(checkpoint)  # no model_config: the base weights are not merged or read
    # The model's tensors are stored under "model." (xorl/checkpoint/state.py; xorl/checkpoint/hf_export.py
    # reads them the same way).
    keys = [key for key in source.metadata.state_dict_metadata if key.startswith("model.") and is_adapter_name(key)]
    if not keys:
        raise ValueError(f"{checkpoint} holds no LoRA adapter (model.lora was not set): export the model without "
                         "--adapter")
    state = {}
    for key in keys:
        name = key.removeprefix("model.")
        state[peft_key(name)] = peft_tensor(name, source.get(key).to(torch.float32)).contiguous()
    write_adapter(state, model_config, folder)
    return len(state)


def write_adapter(state: dict[str, torch.Tensor], model_config, folder: str) -> None:
    """adapter_model.safetensors + adapter_config.json into ``folder``, atomically (``.partial``, renamed)."""
    from safetensors.torch import save_file

    folder = os.path.normpath(folder)
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(state, os.path.join(partial, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(partial, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(adapter_config(model_config.lora, model_config.model_path), f, indent=2)
    _swap_into_place(partial, folder)
