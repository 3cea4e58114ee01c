"""How many slices of each GQA group the dK/dV kernel runs in parallel (see attention/bwd_triton.py)."""

from __future__ import annotations

import torch
import triton

from xorl_kernels.attention.common import INTERPRET

# Programs the dK/dV grid should give the GPU at least: 4 per SM, so that the causal imbalance
# between key blocks (the first sees every query row, the last a few) evens out over the SMs.
_PROGRAMS_PER_SM = 4
# The largest key block of the autotune configs: the program count below never overestimates.
_LARGEST_BLOCK_N = 128
_INTERPRETER_SMS = 132  # under the interpreter, plan as for an H100 (tests then cover the slices)


def dkdv_head_splits(total_k: int, num_docs: int, heads_kv: int, group: int, sms: int) -> int:
    """Slices of each GQA group the dK/dV kernel runs in parallel: the smallest divisor of ``group``
    that gives at least _PROGRAMS_PER_SM programs per SM, else ``group`` (one query head each).

    Programs are counted from the tokens (ceil(total_k / 128) key blocks per KV head, plus one per
    document for its partial block), not from the padded grid: empty programs do no work. The fp32
    scratch is splits x the size of dK and dV, and splits only exceeds 1 while the key blocks are too
    few to fill the GPU, so it holds about _PROGRAMS_PER_SM * SMs * 128 rows (35 MB at head_dim 128
    on an H100) per tensor whatever the sequence length; up to twice that where the divisors of
    ``group`` are coarse.
    """
    if group <= 1:
        return 1
    programs = heads_kv * (triton.cdiv(total_k, _LARGEST_BLOCK_N) + num_docs)
    for splits in range(1, group + 1):
        if group % splits == 0 and programs * splits >= _PROGRAMS_PER_SM * sms:
            return splits
    return group


def device_sms(device: torch.device) -> int:
    if INTERPRET:
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count  # cached by torch: no sync
