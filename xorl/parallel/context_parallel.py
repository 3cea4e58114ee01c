"""Context-parallel plan: swap every attention block's ``core_attention`` for the CP one.

Ring only: ``RingAttention`` (xorl/nn/ring_attention.py: the zig-zag ring and its point-to-point
primitive). Ulysses (alone or with a ring): ``ContextParallelAttention`` (xorl/nn/ulysses_attention.py:
the Ulysses all-to-all around a ring, which is local attention when the ring has one rank).

    record = apply_context_parallel(model, ring_group, ulysses_group)

Works on xorl.models (the attention block calls ``self.core_attention(q, k, v, cu_seqlens=...,
max_seqlen=...)``) and on any module tree with ``core_attention`` attributes. The inputs must then
be zig-zag sharded (``xorl.distributed.zigzag.prepare_context_parallel_batch``): the model gets
this rank's tokens, labels and position ids and the GLOBAL ``cu_seqlens`` / ``max_seqlen``.
Everything outside attention is per-token, so nothing else changes; the loss over the shards is
the sum of the per-rank ``loss * num_label_tokens`` (all-reduce it over the CP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from xorl.nn.ring_attention import RingAttention
from xorl.nn.ulysses_attention import ContextParallelAttention


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass
class ContextParallelRecord:
    """What ``apply_context_parallel`` did: the groups the attention blocks now exchange over."""

    ring_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_size: int
    ulysses_size: int
    attention_blocks: int  # core_attention modules swapped


def apply_context_parallel(model: nn.Module, ring_group=None, ulysses_group=None,
                           **ring_options) -> ContextParallelRecord:
    """Replace each ``core_attention`` with RingAttention(ring_group) (no Ulysses) or
    ContextParallelAttention(ring_group, ulysses_group).

    The softmax scale of the replaced module is kept (``softmax_scale`` attribute); ``ring_options``
    go to RingAttention (e.g. ``dkv_comm_dtype``, ``attn_backend``). Changes the model in place;
    returns what was done. With both groups of size 1 nothing is swapped.
    """
    if _size(ring_group) == 1 and _size(ulysses_group) == 1:
        return ContextParallelRecord(ring_group, ulysses_group, 1, 1, 0)
    swapped = 0
    for module in model.modules():
        old = getattr(module, "core_attention", None)
        if old is None or isinstance(old, ContextParallelAttention) or \
                (isinstance(old, RingAttention) and old.ring_size > 1):
            continue
        options = dict(ring_options)
        options.setdefault("softmax_scale", getattr(old, "softmax_scale", None))
        if _size(ulysses_group) == 1:
            module.core_attention = RingAttention(ring_group, **options)
        else:
            module.core_attention = ContextParallelAttention(ring_group, ulysses_group, **options)
        swapped += 1
    if swapped == 0:
        raise ValueError(
            "apply_context_parallel found no module with a `core_attention` attribute (xorl.models "
            "build one per attention layer; the transformers drop-in was removed, see the README)"
        )
    return ContextParallelRecord(ring_group, ulysses_group, _size(ring_group), _size(ulysses_group), swapped)
