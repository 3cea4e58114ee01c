"""Tensor parallelism's communication: the TP group, its communication record, the ring collectives
and the plain collectives along the sequence dim. The region boundaries built on them are in
``xorl/nn/tp_regions.py``; the overlapped matmuls of the TP linears in ``xorl/nn/tp_matmul.py``.

Two ring primitives carry every overlapped TP matmul (``xorl/nn/tp_matmul.py``'s column / row math):

* ``ring_all_gather(local, tp, consume)``: every rank's chunk passes once around the ring; while
  chunk i is handed to ``consume`` (a GEMM), chunk i+1 is already travelling to us. P-1 exchanges.
* ``ring_reduce_scatter(produce, tp)``: partial sums travel around the ring, each rank adding its
  own contribution; while one partial travels, ``produce`` (a GEMM) computes the next. P-1
  exchanges, and rank r ends holding the full sum of chunk r.

Why point-to-point rather than a collective per chunk: a ring exchange moves exactly one chunk
per rank per step, so the transfer of step i is the same size as the GEMM it hides behind, and
no rank ever waits for all the others (Megatron / torchtitan async-TP decompose the same way).

Each exchange goes through the one ring primitive, ``xorl.distributed.p2p.RingExchange``: on GPU it
is issued on a side stream that first waits for the compute stream (so the buffers are ready), and
waiting makes the compute stream wait for the transfer; on gloo the ops run on gloo's threads while
Python does the GEMM. Below ``DEFAULT_OVERLAP_MIN_NUMEL`` elements the matmuls take the plain
collectives instead.

The record (``overlap_report(model)``): per layer name, the P2P ops issued, the chunked GEMMs,
the plain collectives, and on GPU the milliseconds the compute stream stood waiting at the wait
points (CUDA events recorded just before and after each wait, once the group's
``record_exposed_time()`` turned it on; resolved when the report is read, so the step itself
never synchronises). Otherwise, and on CPU, exposed time is not recorded (``None``). The record
lives on each layer's ``TPGroup`` (no module-level state): the report walks the modules it is given.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from xorl.distributed.p2p import PendingExchange, RingExchange

# ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are deprecated in newer torch in favour of
# the ``*_single`` names, which older torch (2.11 on the GPU machines) may lack.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TPGroup:
    """A tensor-parallel process group with its size, this rank's index and its ring exchange."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ring = RingExchange(group) if self.size > 1 else None
        self.comm_stats: dict[str, LayerCommStats] = {}  # layer name -> its record (overlap_report)
        self.time_exposed = False

    def layer_stats(self, name: str) -> LayerCommStats:
        """The (created on first use) record of layer ``name`` on this group."""
        stats = self.comm_stats.get(name)
        if stats is None:
            stats = self.comm_stats[name] = LayerCommStats(timed=self.time_exposed)
        return stats

    def record_exposed_time(self, enabled: bool = True) -> None:
        """Turn on (or off) the per-wait CUDA-event timing read by ``overlap_report()["exposed_ms"]``.

        Off by default, so a training step creates no events; when on, finished pairs are folded
        into the total as new ones are recorded, so the list stays at the pairs still in flight.
        """
        self.time_exposed = enabled
        for stats in self.comm_stats.values():
            stats.timed = enabled

    @classmethod
    def from_mesh(cls, tp_mesh) -> TPGroup:
        if tp_mesh is None or getattr(tp_mesh, "ndim", None) != 1:
            raise ValueError(
                f"tp_mesh must be a 1-D DeviceMesh (e.g. parallel_state.mesh['tp']), got {tp_mesh!r}"
            )
        return cls(tp_mesh.get_group())


@dataclass
class LayerCommStats:
    """What one layer's TP communication did since the last reset (see ``overlap_report``)."""

    p2p_ops: int = 0  # isend + irecv ops issued by the ring primitives
    ring_steps: int = 0  # ring exchanges (P-1 per ring)
    chunk_gemms: int = 0  # GEMMs issued on one sequence chunk
    collectives: int = 0  # plain (non-decomposed) collectives
    # Bytes this rank sends: a ring exchange its chunk; a plain all-gather (P-1) x its shard, a
    # reduce-scatter (P-1)/P of its input, an all-reduce 2 (P-1)/P (what a bandwidth-optimal ring sends).
    sent_bytes: int = 0
    _events: deque = field(default_factory=deque, repr=False)  # (start, end) CUDA event pairs in flight
    exposed_ms_resolved: float = 0.0
    timed: bool = False  # record exposed time (the group's record_exposed_time)
    seen_gpu: bool = False  # a timed wait happened on the GPU

    def exposed_ms(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            self._resolve(block=True)
        return self.exposed_ms_resolved

    def _resolve(self, block: bool) -> None:
        """Fold finished event pairs into the total (without waiting unless ``block``)."""
        while self._events and (block or self._events[0][1].query()):
            start, end = self._events.popleft()
            self.exposed_ms_resolved += start.elapsed_time(end)


def overlap_report(*modules, reset: bool = False) -> dict[str, dict]:
    """Per layer of ``modules`` (and their submodules): p2p_ops, ring_steps, chunk_gemms,
    collectives and exposed_ms (None on CPU or with timing off).

    Read it after a step; on GPU this synchronises once to resolve the CUDA events. ``reset``
    clears the records it read.
    """
    groups = {}
    for module in modules:
        for sub in module.modules():
            tp = getattr(sub, "tp", None)
            if isinstance(tp, TPGroup):
                groups[id(tp)] = tp
    report = {}
    for tp in groups.values():
        for name, s in tp.comm_stats.items():
            report[name] = {
                "p2p_ops": s.p2p_ops,
                "ring_steps": s.ring_steps,
                "chunk_gemms": s.chunk_gemms,
                "collectives": s.collectives,
                "sent_bytes": s.sent_bytes,
                "exposed_ms": s.exposed_ms() if s.seen_gpu and s.timed else None,
            }
        if reset:
            tp.comm_stats.clear()
    return report


def wait_all(works, stats: LayerCommStats, on_gpu: bool) -> None:
    """Wait for ``works`` (collective works or PendingExchange); on GPU, with timing on, record how
    long the compute stream stood still doing so."""
    if not works:
        return
    if on_gpu and stats.timed:
        stats.seen_gpu = True
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for work in works:
            work.wait()
        end.record()
        stats._resolve(block=False)
        stats._events.append((start, end))
    else:
        for work in works:
            work.wait()


def _exchange(sends, recvs, tp: TPGroup, stats: LayerCommStats, reverse: bool) -> list[PendingExchange]:
    """Start sending each of ``sends`` to the next rank and receiving the matching one of ``recvs``
    from the previous (``reverse``: the other way); one ring step, a tag per tensor."""
    stats.p2p_ops += 2 * len(sends)
    stats.ring_steps += 1
    stats.sent_bytes += sum(t.nbytes for t in sends)
    return [tp.ring.start(send, recv, tag=tag, reverse=reverse) for tag, (send, recv) in enumerate(zip(sends, recvs))]


def ring_all_gather(local, tp: TPGroup, consume: Callable, stats: LayerCommStats) -> None:
    """Call ``consume(chunk, src_rank)`` on every rank's ``local`` (own first) while the next travels.

    ``local``: a tensor, or a tuple of tensors that travel together (an FP8 chunk and its scales,
    xorl/nn/tp_fp8.py), handed to ``consume`` as such. Never written. Chunks travel forward (rank r
    sends to r+1), so at step i rank r holds the chunk of rank r-i. Two receive buffers alternate:
    the one being consumed is never the one being received into.
    """
    single = isinstance(local, torch.Tensor)
    parts = [t.contiguous() for t in ((local,) if single else local)]
    size, rank = tp.size, tp.rank
    on_gpu = parts[0].is_cuda
    buffers = [[torch.empty_like(t) for t in parts] for _ in range(2)] if size > 1 else []
    current = parts
    for step in range(size):
        works = []
        if step < size - 1:
            incoming = buffers[step % 2]
            works = _exchange(current, incoming, tp, stats, reverse=False)
        consume(current[0] if single else tuple(current), (rank - step) % size)
        stats.chunk_gemms += 1
        if works:
            wait_all(works, stats, on_gpu)
            current = incoming


def ring_reduce_scatter(produce: Callable[[int], torch.Tensor], tp: TPGroup,
                        stats: LayerCommStats) -> torch.Tensor:
    """Return sum over ranks of ``produce(tp.rank)``, computing ``produce(c)`` for every chunk c.

    ``produce(c)`` must return a fresh contiguous tensor (this rank's partial for chunk c). Partial
    sums travel backward (rank r sends to r-1): at step i rank r computes chunk (r+1+i) mod P,
    adds the partial received for that chunk and passes it on; the GEMM of step i+1 runs while
    the partial of step i travels. At the last step the chunk is r itself and the sum is complete.
    """
    size, rank = tp.size, tp.rank
    received = None
    works: list = []
    in_flight = None  # keeps the buffer being sent alive until its send completes
    for step in range(size):
        partial = produce((rank + 1 + step) % size)
        stats.chunk_gemms += 1
        if works:
            wait_all(works, stats, partial.is_cuda)
            partial += received
            in_flight = None
        if step == size - 1:
            return partial
        if received is None:
            received = torch.empty_like(partial)
        works = _exchange([partial], [received], tp, stats, reverse=True)
        in_flight = partial  # noqa: F841 - held only to keep the send buffer alive
    raise AssertionError("unreachable: the loop returns at its last step")


# -- plain collectives along the sequence dim (dim -2), used below the overlap cutoff ------------

def check_sequence_divisible(seq_len: int, tp: TPGroup, what: str) -> int:
    if seq_len % tp.size:
        raise ValueError(
            f"{what}: sequence length {seq_len} is not divisible by tensor_parallel_size={tp.size}; "
            "under sequence parallel pad every micro-batch to a multiple of the TP size"
        )
    return seq_len // tp.size


def all_gather_stacked(parts, tp: TPGroup, stats: LayerCommStats) -> list[torch.Tensor]:
    """Every rank's ``parts`` (tensors), each as [P, *its shape]: rank-stacked, in rank order."""
    parts = [t.contiguous() for t in parts]
    outs = [t.new_empty(tp.size, *t.shape) for t in parts]
    stats.collectives += len(parts)
    stats.sent_bytes += (tp.size - 1) * sum(t.nbytes for t in parts)
    # Collectives take the rank-stacked buffer flattened into dim 0 ([P*d0, ...]).
    works = [all_gather_single(out.flatten(0, 1), t, group=tp.group, async_op=True) for out, t in zip(outs, parts)]
    wait_all(works, stats, parts[0].is_cuda)
    return outs


def all_gather_sequence(x: torch.Tensor, tp: TPGroup, stats: LayerCommStats) -> torch.Tensor:
    """[..., s/P, h] on every rank -> [..., s, h] (rank r's shard at rows r*s/P ...)."""
    (out,) = all_gather_stacked([x], tp, stats)
    # [P, ..., s/P, h] -> [..., P, s/P, h] -> [..., s, h]
    return out.movedim(0, -3).flatten(-3, -2)


def reduce_scatter_sequence(y: torch.Tensor, tp: TPGroup, stats: LayerCommStats) -> torch.Tensor:
    """[..., s, h] partial on every rank -> this rank's [..., s/P, h] shard of the sum."""
    shard = check_sequence_divisible(y.shape[-2], tp, "reduce-scatter")
    stacked = y.unflatten(-2, (tp.size, shard)).movedim(-3, 0).contiguous()
    out = y.new_empty(stacked.shape[1:])
    stats.collectives += 1
    stats.sent_bytes += out.nbytes * (tp.size - 1)
    work = reduce_scatter_single(out, stacked.flatten(0, 1), group=tp.group, async_op=True)
    wait_all([work], stats, y.is_cuda)
    return out


def all_reduce_async(x: torch.Tensor, tp: TPGroup, stats: LayerCommStats, op=dist.ReduceOp.SUM):
    stats.collectives += 1
    stats.sent_bytes += 2 * x.nbytes * (tp.size - 1) // tp.size
    return dist.all_reduce(x, op=op, group=tp.group, async_op=True)


def all_reduce_max(x: torch.Tensor, tp: TPGroup, stats: LayerCommStats) -> torch.Tensor:
    """``x`` (a device tensor, e.g. an amax) replaced by its elementwise max over the TP group; the
    compute stream waits for it, the host does not."""
    wait_all([all_reduce_async(x, tp, stats, dist.ReduceOp.MAX)], stats, x.is_cuda)
    return x



# Below this many elements of the gathered activation the TP matmuls (xorl/nn/tp_matmul.py) run the
# plain collective and one GEMM instead of the ring. 4 Mi elements (e.g. 1024 tokens x 4096 hidden):
# below this the chunks are too small to hide the transfer latency behind a GEMM on an H100.
DEFAULT_OVERLAP_MIN_NUMEL = 1 << 22
