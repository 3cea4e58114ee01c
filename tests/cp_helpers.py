"""Shared pieces of the context-parallel tests: float64 reference attention, CP groups, error sums,
and counters of the bytes each rank sends (wrapping torch.distributed, not our comm helper)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_GROUPS: dict[tuple[int, int], tuple] = {}


def reference_attention(q, k, v, cu_seqlens=None, causal=True, scale=None):
    """Float64 plain-torch attention on the FULL sequence: q [b, T, hq, d], k/v [b, T, hkv, d]."""
    q, k, v = (t.double() for t in (q, k, v))
    b, T, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scale = d**-0.5 if scale is None else scale
    pos = torch.arange(T)
    cu = torch.tensor([0, T]) if cu_seqlens is None else torch.as_tensor(cu_seqlens).long()
    doc = torch.searchsorted(cu[1:], pos, right=True)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def cp_groups(ring_size: int, ulysses_size: int):
    """(ring_group, ulysses_group) of the default world, Ulysses inner: flat rank = r * U + u.

    Cached per shape because every rank must create every group, in the same order, once.
    """
    key = (ring_size, ulysses_size)
    if key not in _GROUPS:
        world = dist.get_world_size()
        if world != ring_size * ulysses_size:
            raise ValueError(f"world {world} != ring {ring_size} × ulysses {ulysses_size}")
        rank = dist.get_rank()
        ring_group = ulysses_group = None
        for u in range(ulysses_size):
            g = dist.new_group([r * ulysses_size + u for r in range(ring_size)])
            if rank % ulysses_size == u:
                ring_group = g
        for r in range(ring_size):
            g = dist.new_group([r * ulysses_size + u for u in range(ulysses_size)])
            if rank // ulysses_size == r:
                ulysses_group = g
        _GROUPS[key] = (ring_group, ulysses_group)
    return _GROUPS[key]


def sq_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(‖out − ref‖², ‖ref‖²) so per-rank pieces can be summed into one relative error."""
    out, ref = out.detach().double(), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return float((out - ref).pow(2).sum()), float(ref.pow(2).sum())


def rel_err(pieces) -> float:
    """Relative error from per-rank (‖out − ref‖², ‖ref‖²) pairs."""
    num = sum(p[0] for p in pieces)
    den = sum(p[1] for p in pieces)
    return (num / den) ** 0.5


class SendCounter:
    """Counts what this rank sends through torch.distributed while active.

    ``p2p_sends``: bytes of every isend posted via batch_isend_irecv / isend / send;
    ``all_to_all``: (total buffer bytes, bytes leaving this rank) of each all_to_all_single.
    """

    def __init__(self):
        self.p2p_sends: list[int] = []
        self.all_to_all: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def active(self):
        orig_batch, orig_a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def batch(ops):
            for op in ops:
                if getattr(op.op, "__name__", "") == "isend":
                    self.p2p_sends.append(op.tensor.numel() * op.tensor.element_size())
            return orig_batch(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            size = dist.get_world_size(group)
            total = input.numel() * input.element_size()
            if input_split_sizes is None:
                leaving = total - total // size
            else:
                row = total // max(input.shape[0], 1)
                leaving = total - input_split_sizes[dist.get_rank(group)] * row
            self.all_to_all.append((total, leaving))
            return orig_a2a(output, input, output_split_sizes, input_split_sizes, group, async_op)

        dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a
        try:
            yield self
        finally:
            dist.batch_isend_irecv, dist.all_to_all_single = orig_batch, orig_a2a
