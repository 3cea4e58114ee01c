"""Export the trained (sharded) model to a local Hugging Face safetensors folder."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def export_hf(model, config, folder: str) -> None:
    """Gather full weights on every rank's CPU (collective), then rank 0 writes the folder."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        from xorl.models.hf_io import save_hf_weights

        save_hf_weights(state, folder, config.model)
    if dist.is_initialized():
        dist.barrier()
