"""Export the trained (sharded) model to a local Hugging Face safetensors folder."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective): FSDP, TP and EP shards are DTensors,
    which the state-dict helper gathers (experts to their global [E, ...] shape)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def export_hf(model, config, folder: str) -> None:
    """Gather full weights (collective), then rank 0 writes the folder."""
    state = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        from xorl.models.hf_io import save_hf_weights

        save_hf_weights({k: v.cpu() for k, v in state.items()}, folder, config.model)
    if dist.is_initialized():
        dist.barrier()
