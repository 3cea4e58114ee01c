"""Export the trained (sharded) model to a local Hugging Face safetensors folder."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

EXPERT_KEY = ".mlp.experts."


def full_state_dict(model, ep_group=None) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective): FSDP/TP shards are gathered by the
    state-dict helpers; expert shards of an EP group are concatenated along the expert dim."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return state
    ep = dist.get_world_size(ep_group)
    for key in sorted(k for k in state if EXPERT_KEY in k):
        local = state[key].contiguous()
        parts = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(parts, local, group=ep_group)
        state[key] = torch.cat(parts, dim=0)  # EP rank r holds experts [r*E/ep, (r+1)*E/ep)
    return state


def export_hf(model, config, folder: str, ep_group=None) -> None:
    """Gather full weights (collective), then rank 0 writes the folder."""
    state = full_state_dict(model, ep_group)
    if not dist.is_initialized() or dist.get_rank() == 0:
        from xorl.models.hf_io import save_hf_weights

        save_hf_weights({k: v.cpu() for k, v in state.items()}, folder, config.model)
    if dist.is_initialized():
        dist.barrier()
