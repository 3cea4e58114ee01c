"""Export the trained (sharded) model to a local Hugging Face safetensors folder."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def full_state_dict(parts, pp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective).

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


def export_hf(parts, config, folder: str, pp_group=None) -> None:
    """Gather full weights (collective), then rank 0 writes the folder."""
    state = full_state_dict(parts, pp_group)
    if not dist.is_initialized() or dist.get_rank() == 0:
        from xorl.models.hf_io import save_hf_weights

        save_hf_weights({k: v.cpu() for k, v in state.items()}, folder, config.model)
    if dist.is_initialized():
        dist.barrier()
