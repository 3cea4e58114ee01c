"""Hybrid context parallelism: Ulysses all-to-all inside, zig-zag ring across.

    attn = ContextParallelAttention(ring_group, ulysses_group)
    out = attn(q, k, v, cu_seqlens=None, max_seqlen=None)

Sequence layout (exactly what ``zigzag_shard(x, dim, ring_group, cu_seqlens, ulysses=ulysses_group)``
produces): the sequence — each packed document separately — is zig-zag sharded over the ring
ranks (2·ring chunks, ring rank r holds chunks r and 2·ring-1-r), then that ring-local sequence is
split into contiguous equal pieces over the Ulysses ranks. Why this order: the Ulysses
all-to-all concatenates the pieces in rank order, rebuilding the ring-local zig-zag sequence
(with hq/U heads) that the ring attention across ring groups expects. ``cu_seqlens`` are the
GLOBAL document boundaries (every document divisible by 2·ring, total by 2·ring·U).

In the mesh Ulysses is the inner dimension (see DESIGN.md): flat CP rank = ring_rank·U + ulysses_rank,
so the all-to-all stays inside a node and only the ring's point-to-point traffic crosses nodes.
"""

from __future__ import annotations

import torch
from torch import nn

from xorl.nn.ring_attention import RingAttention
from xorl.nn.ulysses_attention import UlyssesAttention


class ContextParallelAttention(nn.Module):
    """Ulysses (``ulysses_group``) × zig-zag ring (``ring_group``) core attention; either group may be
    None (size 1). Keyword options go to the inner RingAttention (causal, softmax_scale,
    dkv_comm_dtype, attn_backend)."""

    def __init__(self, ring_group=None, ulysses_group=None, **ring_options):
        super().__init__()
        self.ring = RingAttention(ring_group, **ring_options)
        self.ulysses = UlyssesAttention(ulysses_group, inner=self.ring)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None, max_seqlen=None):
        return self.ulysses(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
