"""The one ring point-to-point primitive: send to rank+1 and receive from rank-1 (or reversed).

Ring attention (xorl/nn/ring_attention.py) passes K/V (and dK/dV) around its ring with it; tensor
parallelism's overlapped all-gather and reduce-scatter (xorl/nn/tp_comm.py) pass sequence chunks
and partial sums.

One ``start(send, recv)`` posts ONE isend and ONE irecv in a single ``batch_isend_irecv`` (callers
pack K and V — or dK and dV — into one buffer so a step is one message each way). The caller owns
the double buffers: it computes on one while the other is being received.

Why a side stream on GPU: the exchange is issued on a dedicated CUDA stream that first waits for
the work already queued on the compute stream (so a buffer is never overwritten while a kernel
still reads it); ``wait()`` then makes the compute stream wait on the side stream. Neither side
blocks the host, so the next step's attention kernel runs while the blocks are in flight. On CPU
(gloo) ``wait()`` blocks, which is inherent to gloo. The side stream belongs to the exchange (one
per ring group and device, created on first use), not to a module-level table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class PendingExchange:
    """Handle of one posted exchange; ``wait()`` once before reading the received buffer."""

    def __init__(self, works, stream):
        self._works, self._stream = works, stream

    def wait(self) -> None:
        if self._stream is None:
            for work in self._works:
                work.wait()
        else:
            with torch.cuda.stream(self._stream):
                for work in self._works:
                    work.wait()
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        self._works = []


class RingExchange:
    """Neighbour exchange inside ``group`` (None = the default group)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # P2POp wants global ranks (group_peer is newer than torch 2.6).
        self.send_peer = self._global((self.rank + 1) % self.size)
        self.recv_peer = self._global((self.rank - 1) % self.size)
        self._side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> this ring's side stream

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._side_streams:
            self._side_streams[index] = torch.cuda.Stream(device=index)
        return self._side_streams[index]

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0, reverse: bool = False) -> PendingExchange:
        """Post send -> rank+1 and recv <- rank-1 (``reverse``: send -> rank-1, recv <- rank+1).

        Both tensors must stay alive until ``wait()``. ``tag`` keeps two exchanges in flight at
        once apart on gloo (ring backward: K/V and dK/dV).
        """
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("ring exchange buffers must be contiguous")
        to_peer, from_peer = (self.recv_peer, self.send_peer) if reverse else (self.send_peer, self.recv_peer)
        ops = [
            dist.P2POp(dist.isend, send, to_peer, self.group, tag),
            dist.P2POp(dist.irecv, recv, from_peer, self.group, tag),
        ]
        if not send.is_cuda:
            return PendingExchange(dist.batch_isend_irecv(ops), None)
        stream = self._side_stream(send.device)
        stream.wait_stream(torch.cuda.current_stream(send.device))
        with torch.cuda.stream(stream):
            works = dist.batch_isend_irecv(ops)
        return PendingExchange(works, stream)
