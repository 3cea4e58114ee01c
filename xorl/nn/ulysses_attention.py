"""Ulysses (all-to-all) sequence parallel attention, and Ulysses x ring (ContextParallelAttention).

    attn = UlyssesAttention(ulysses_group, inner=None)
    out = attn(q, k, v, cu_seqlens=None, max_seqlen=None, sinks=None, window=None)
    # q [b, s_local, hq, d_qk], k [b, s_local, hkv, d_qk], v [b, s_local, hkv, d_v]; sinks [hq]
    attn = ContextParallelAttention(ring_group, ulysses_group)   # Ulysses inside, zig-zag ring across

Each of the U ranks holds a contiguous piece of the sequence with all heads. ONE all-to-all moves
Q, K and V together (packed in one buffer) to "full sequence, hq/U heads"; the ``inner`` core
attention (default: local flash attention; ContextParallelAttention passes a RingAttention) runs
on that; ONE more all-to-all brings the output back to "sequence piece, all heads". The backward
is the same two all-to-alls in reverse. Because the full (ring-local) sequence is reassembled in
rank order, the GLOBAL ``cu_seqlens`` of packed documents apply directly.

Heads: hq must divide by U. KV heads are split when hkv divides by U; when U divides by hkv they
are replicated so every rank gets the one KV head its hq/U query heads read (their gradients are
summed back); any other combination is an error naming the sizes.

Bytes each rank sends per forward: (U-1)/U · b·s·(hq·d_qk + U·hkv_local·(d_qk + d_v)) elements in
the first all-to-all, (U-1)/U · b·s·hq·d_v in the second (v keeps its own head dim, MLA). Sinks
[hq] are sliced to the rank's hq/U heads; a sliding window passes through to the inner attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xorl._torch_compat import resolve_process_group
from xorl.nn.ring_attention import RingAttention
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES


# ----------------------------------------------------------------------------------------------
# the two directions: pack (xorl_kernels.ulysses.op: csrc kernel on GPU, torch on CPU),
# one all-to-all, unpack. Q, K and V share one buffer, so they travel in one message.
# ----------------------------------------------------------------------------------------------
def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_head(tensors, group, world):
    """Sequence-sharded [b, s, H_t, d] -> head-sharded [b, world·s, H_t/world, d], one all-to-all."""
    from xorl_kernels.ulysses.op import ulysses_pack, ulysses_unpack

    send = ulysses_pack(tensors, world)
    return ulysses_unpack(_all_to_all(send, group), world, [tuple(t.shape) for t in tensors])


def head_to_seq(tensors, group, world):
    """Head-sharded [b, S, h_t, d] -> sequence-sharded [b, S/world, world·h_t, d], one all-to-all."""
    from xorl_kernels.ulysses.op import ulysses_pack_reverse, ulysses_unpack_reverse

    send = ulysses_pack_reverse(tensors, world)
    return ulysses_unpack_reverse(_all_to_all(send, group), world, [tuple(t.shape) for t in tensors])


# The two directions as torch.library custom ops, each the other's backward: the all-to-all runs
# inside them (eager), so torch.compile keeps a Ulysses block in one graph; the group travels by name.
def _group(group_name: str):
    return resolve_process_group(group_name)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::ulysses_seq_to_head")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::ulysses_seq_to_head", mutates_args=())
def _seq_to_head_op(tensors: list[torch.Tensor], group_name: str, world: int) -> list[torch.Tensor]:
    return seq_to_head(tensors, _group(group_name), world)


@_seq_to_head_op.register_fake
def _(tensors, group_name, world):
    return [t.new_empty((t.shape[0], world * t.shape[1], t.shape[2] // world, t.shape[3])) for t in tensors]


SELECTIVE_CHECKPOINT_SAVES.join("xorl::ulysses_head_to_seq")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::ulysses_head_to_seq", mutates_args=())
def _head_to_seq_op(tensors: list[torch.Tensor], group_name: str, world: int) -> list[torch.Tensor]:
    return head_to_seq(tensors, _group(group_name), world)


@_head_to_seq_op.register_fake
def _(tensors, group_name, world):
    return [t.new_empty((t.shape[0], t.shape[1] // world, world * t.shape[2], t.shape[3])) for t in tensors]


def _setup_context(ctx, inputs, output):
    ctx.group_name, ctx.world = inputs[1], inputs[2]


def _seq_to_head_backward(ctx, grads):
    return torch.ops.xorl.ulysses_head_to_seq([g.contiguous() for g in grads], ctx.group_name, ctx.world), None, None


def _head_to_seq_backward(ctx, grads):
    return torch.ops.xorl.ulysses_seq_to_head([g.contiguous() for g in grads], ctx.group_name, ctx.world), None, None


_seq_to_head_op.register_autograd(_seq_to_head_backward, setup_context=_setup_context)
_head_to_seq_op.register_autograd(_head_to_seq_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# heads
# ----------------------------------------------------------------------------------------------
def kv_head_index(heads_q: int, heads_kv: int, world: int) -> torch.Tensor | None:
    """KV heads to send, destination-major ([world · hkv_local]); None when no replication is needed.

    Why replication: with hkv < U a rank's hq/U query heads all read one KV head that no split of
    hkv heads over U ranks can give it, so each KV head is sent to U/hkv ranks.
    """
    if heads_q % world:
        raise ValueError(
            f"num_attention_heads={heads_q} must be divisible by the Ulysses size {world} "
            "(ulysses_parallel_size); choose a Ulysses size that divides the query heads"
        )
    if heads_kv % world == 0:
        return None
    if world % heads_kv == 0:
        return torch.arange(world) // (world // heads_kv)
    raise ValueError(
        f"num_key_value_heads={heads_kv} and Ulysses size {world}: one must divide the other (KV heads are "
        "split when they divide by the Ulysses size and replicated when the Ulysses size divides by them)"
    )




class UlyssesAttention(nn.Module):
    """Ulysses all-to-all attention over ``ulysses_group``; ``inner`` is the core attention run on
    the full (ring-local) sequence with hq/U heads (default: causal local flash attention)."""

    def __init__(self, ulysses_group=None, inner: nn.Module | None = None):
        super().__init__()
        self.ulysses_group = ulysses_group
        self.inner = inner if inner is not None else RingAttention(None)  # no group: local attention
        self.ulysses_size = 1 if ulysses_group is None else dist.get_world_size(ulysses_group)
        self._group_name = "" if ulysses_group is None else ulysses_group.group_name

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None, sinks=None, window=None):
        """``sinks`` [hq] (every query head's, replicated); this rank's inner attention takes the
        slice of its hq/U heads, so each rank's gradient lands on its own heads' entries.
        ``window`` passes through (the inner attention sees the whole ring-local sequence)."""
        world = self.ulysses_size
        # Only when set: an inner attention written before sinks and windows still works without them.
        extra = {} if window is None else {"window": window}
        if world == 1:
            if sinks is not None:
                extra["sinks"] = sinks
            return self.inner(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **extra)
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2]:
            raise ValueError(
                f"q must be [b, s, hq, d_qk], k [b, s, hkv, d_qk] and v [b, s, hkv, d_v] with the same b, s; "
                f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        index = kv_head_index(q.shape[2], k.shape[2], world)
        if index is not None:
            # index = arange(world) // repeats: repeat each KV head in place, with no index tensor
            # to copy from host memory in every layer.
            repeats = world // k.shape[2]
            k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        if sinks is not None:
            if tuple(sinks.shape) != (q.shape[2],):
                raise ValueError(f"sinks must be [heads_q] = [{q.shape[2]}], got {tuple(sinks.shape)}")
            local_heads = q.shape[2] // world
            rank = dist.get_rank(self.ulysses_group)
            extra["sinks"] = sinks[rank * local_heads : (rank + 1) * local_heads]  # the all-to-all's head order
        # Q, K and V travel in one message even when v is narrower than q/k (each keeps its width).
        qh, kh, vh = torch.ops.xorl.ulysses_seq_to_head(
            [q.contiguous(), k.contiguous(), v.contiguous()], self._group_name, world
        )
        out = self.inner(qh, kh, vh, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **extra)
        (out,) = torch.ops.xorl.ulysses_head_to_seq([out.contiguous()], self._group_name, world)
        return out

    def extra_repr(self) -> str:
        return f"ulysses_size={self.ulysses_size}"


class ContextParallelAttention(nn.Module):
    """Hybrid context parallelism: Ulysses all-to-all (``ulysses_group``) inside, zig-zag ring
    (``ring_group``) across; either group may be None (size 1). Keyword options go to the inner
    RingAttention (causal, softmax_scale, dkv_comm_dtype, attn_backend).

    Sequence layout (exactly what ``zigzag_shard(x, dim, ring_group, cu_seqlens, ulysses=ulysses_group)``
    produces): the sequence, each packed document separately, is zig-zag sharded over the ring
    ranks (2·ring chunks, ring rank r holds chunks r and 2·ring-1-r), then that ring-local sequence
    is split into contiguous equal pieces over the Ulysses ranks. Why this order: the Ulysses
    all-to-all concatenates the pieces in rank order, rebuilding the ring-local zig-zag sequence
    (with hq/U heads) that the ring attention across ring groups expects. ``cu_seqlens`` are the
    GLOBAL document boundaries (every document divisible by 2·ring, total by 2·ring·U).

    In the mesh Ulysses is the inner dimension (see DESIGN.md): flat CP rank = ring_rank·U + ulysses_rank,
    so the all-to-all stays inside a node and only the ring's point-to-point traffic crosses nodes.
    """

    def __init__(self, ring_group=None, ulysses_group=None, **ring_options):
        super().__init__()
        self.ring = RingAttention(ring_group, **ring_options)
        self.ulysses = UlyssesAttention(ulysses_group, inner=self.ring)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None, max_seqlen=None,
                sinks=None, window=None):  # fmt: skip
        return self.ulysses(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, sinks=sinks, window=window)
