"""The loss one process would compute, whatever the layout.

The training loss is the token-weighted mean over every data-parallel and context-parallel rank
and every microbatch of the optimizer step: sum of per-token cross-entropies / number of label
tokens in the global batch. Each rank therefore backpropagates ``local_sum / global_tokens`` and
gradients are SUMMED (never averaged) across ranks and microbatches; averaging per rank or per
microbatch would weight tokens unequally whenever ranks hold different numbers of label tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xorl.nn.cross_entropy import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "count_label_tokens"]


def count_label_tokens(microbatches: list[dict], group, device: torch.device) -> torch.Tensor:
    """Label tokens of the whole optimizer step over the data × context-parallel ranks (int64).

    The labels come from the loader on the host, so counting them reads no device memory; the sum
    over ranks runs on ``device`` (NCCL serves device tensors only) and stays there: the loss
    divides by it on the device, so the step never waits for it.
    """
    local = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)
    total = torch.tensor([local], dtype=torch.int64).to(device, non_blocking=True)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total[0]

