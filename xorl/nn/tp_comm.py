"""Tensor parallelism's communication: the TP group, its ring collectives, region boundaries, the
communication record, and the overlapped matmuls built on them (the autograd functions of the TP
linears, at the end of this file).

Two ring primitives carry every overlapped TP matmul (``ColumnParallelMatmul`` / ``RowParallelMatmul`` below):

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
Python does the GEMM.

Region boundaries (each says what its backward does, because that is where TP goes wrong):

* ``split_to_shard(x, dim)``: x is replicated; keep this rank's chunk. Backward all-gathers, so the
  upstream gradient is again full and identical on every rank (entering the sequence-parallel
  region after the embedding; a row layer whose input is not yet parallel).
* ``gather_from_shards(x, dim)``: every rank holds its chunk; return the full tensor. Backward
  keeps this rank's chunk of the gradient: the code after the gather runs identically on every
  rank (replicated lm_head and loss), so the gradient is already complete everywhere; summing it
  would count it P times.
* ``sum_partials(x)`` / ``sum_partials_to_shard(x, dim)``: every rank holds a partial sum (a
  vocabulary-parallel embedding's rows); all-reduce it, or reduce-scatter it along ``dim``
  straight into the sequence-parallel shard. Backward: identity / all-gather, since each rank's
  partial was computed from the same upstream values.

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
import torch.nn.functional as F

from xorl.distributed.p2p import PendingExchange, RingExchange

# ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are deprecated in newer torch in favour of
# the ``*_single`` names, which older torch (2.11 on the GPU machines) may lack.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def _exchange(send: torch.Tensor, recv: torch.Tensor, tp: TPGroup, stats: LayerCommStats,
              reverse: bool) -> list[PendingExchange]:
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous (``reverse``: the other way)."""
    stats.p2p_ops += 2
    stats.ring_steps += 1
    return [tp.ring.start(send, recv, reverse=reverse)]


def ring_all_gather(local: torch.Tensor, tp: TPGroup, consume: Callable[[torch.Tensor, int], None],
                    stats: LayerCommStats) -> None:
    """Call ``consume(chunk, src_rank)`` on every rank's ``local`` (own first) while the next travels.

    ``local`` is never written. Chunks travel forward (rank r sends to r+1), so at step i rank r
    holds the chunk of rank r-i. Two receive buffers alternate: the one being consumed is never
    the one being received into.
    """
    local = local.contiguous()
    size, rank = tp.size, tp.rank
    on_gpu = local.is_cuda
    buffers = [torch.empty_like(local), torch.empty_like(local)] if size > 1 else []
    current = local
    for step in range(size):
        works = []
        if step < size - 1:
            incoming = buffers[step % 2]
            works = _exchange(current, incoming, tp, stats, reverse=False)
        consume(current, (rank - step) % size)
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
        works = _exchange(partial, received, tp, stats, reverse=True)
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


def all_gather_sequence(x: torch.Tensor, tp: TPGroup, stats: LayerCommStats) -> torch.Tensor:
    """[..., s/P, h] on every rank -> [..., s, h] (rank r's shard at rows r*s/P ...)."""
    x = x.contiguous()
    out = x.new_empty(tp.size, *x.shape)
    stats.collectives += 1
    # Collectives take the rank-stacked buffer flattened into dim 0 ([P*d0, ...]).
    work = _all_gather_single(out.flatten(0, 1), x, group=tp.group, async_op=True)
    wait_all([work], stats, x.is_cuda)
    # [P, ..., s/P, h] -> [..., P, s/P, h] -> [..., s, h]
    return out.movedim(0, -3).flatten(-3, -2)


def reduce_scatter_sequence(y: torch.Tensor, tp: TPGroup, stats: LayerCommStats) -> torch.Tensor:
    """[..., s, h] partial on every rank -> this rank's [..., s/P, h] shard of the sum."""
    shard = check_sequence_divisible(y.shape[-2], tp, "reduce-scatter")
    stacked = y.unflatten(-2, (tp.size, shard)).movedim(-3, 0).contiguous()
    out = y.new_empty(stacked.shape[1:])
    stats.collectives += 1
    work = _reduce_scatter_single(out, stacked.flatten(0, 1), group=tp.group, async_op=True)
    wait_all([work], stats, y.is_cuda)
    return out


def all_reduce_async(x: torch.Tensor, tp: TPGroup, stats: LayerCommStats):
    stats.collectives += 1
    return dist.all_reduce(x, group=tp.group, async_op=True)


# -- region boundaries along any dim -----------------------------------------------------------

def _all_gather_dim(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    dim = dim % x.dim()
    x = x.contiguous()
    out = x.new_empty(tp.size, *x.shape)
    _all_gather_single(out.flatten(0, 1), x, group=tp.group)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _own_chunk(x: torch.Tensor, tp: TPGroup, dim: int, what: str) -> torch.Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"{what}: dim {dim} has size {x.shape[dim]}, not divisible by tensor_parallel_size={tp.size}; "
            "pad it to a multiple of the TP size"
        )
    shard = x.shape[dim] // tp.size
    return x.narrow(dim, tp.rank * shard, shard).contiguous()


class _SplitToShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim
        return _own_chunk(x, tp, dim, "split_to_shard")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.tp, ctx.dim), None, None


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim
        return _all_gather_dim(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.tp, ctx.dim, "gather_from_shards backward"), None, None


def to_head_parallel(x: torch.Tensor, tp: TPGroup, sequence_dim: int | None = None) -> torch.Tensor:
    """A replicated activation that every TP rank's heads then use (MLA's shared RoPE key): the
    forward keeps it (or, under sequence parallel, all-gathers the sequence along ``sequence_dim``);
    the backward sums the ranks' partial gradients (all-reduce, or reduce-scatter back to the shard),
    as a column layer does for its input."""
    if tp.size == 1:
        return x
    # the same autograd pair LoRA's adapters use (copy_to_region / gather_summing_grads below)
    return copy_to_region(x, tp) if sequence_dim is None else gather_summing_grads(x, tp, sequence_dim)


def split_to_shard(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Replicated x -> this rank's chunk along ``dim``; backward all-gathers the gradient."""
    return x if tp.size == 1 else _SplitToShard.apply(x, tp, dim)


def gather_from_shards(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Per-rank chunks -> the full tensor along ``dim``; backward keeps this rank's gradient chunk."""
    return x if tp.size == 1 else _GatherFromShards.apply(x, tp, dim)


class _SumPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup):
        x = x.contiguous()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumPartialsToShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim % x.dim()
        d = ctx.dim
        if x.shape[d] % tp.size:
            raise ValueError(
                f"sum_partials_to_shard: dim {d} has size {x.shape[d]}, not divisible by tensor_parallel_size="
                f"{tp.size}; under sequence parallel pad every micro-batch to a multiple of the TP size"
            )
        stacked = x.unflatten(d, (tp.size, x.shape[d] // tp.size)).movedim(d, 0).contiguous()
        out = x.new_empty(stacked.shape[1:])
        _reduce_scatter_single(out, stacked.flatten(0, 1), group=tp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.tp, ctx.dim), None, None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _GatherSummingGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int):
        ctx.tp, ctx.dim = tp, dim % x.dim()
        return _all_gather_dim(x, tp, ctx.dim)

    @staticmethod
    def backward(ctx, grad):
        d, tp = ctx.dim, ctx.tp
        stacked = grad.unflatten(d, (tp.size, grad.shape[d] // tp.size)).movedim(d, 0).contiguous()
        out = grad.new_empty(stacked.shape[1:])
        _reduce_scatter_single(out, stacked.flatten(0, 1), group=tp.group)
        return out, None, None


def copy_to_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """x replicated, entering code that differs per rank (a rank's output columns): identity forward;
    backward all-reduces the gradient, the sum of every rank's partial (Megatron's copy_to_region)."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp)


def gather_summing_grads(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Per-rank chunks -> the full tensor along ``dim``, used afterwards differently by each rank
    (a rank's output columns): backward reduce-scatters, each rank's chunk of the summed gradient."""
    return x if tp.size == 1 else _GatherSummingGrads.apply(x, tp, dim)


def sum_partials(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Partial sums on every rank -> their sum on every rank; backward passes the gradient through."""
    return x if tp.size == 1 else _SumPartials.apply(x, tp)


def sum_partials_to_shard(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Partial sums on every rank -> this rank's chunk (along ``dim``) of their sum; backward all-gathers."""
    return x if tp.size == 1 else _SumPartialsToShard.apply(x, tp, dim)


# ==============================================================================================
# The overlapped TP matmuls (the autograd functions of ColumnParallelLinear / RowParallelLinear)
#
# Autograd functions of the TP linears: all-gather→matmul and matmul→reduce-scatter, chunked.
#
# Layout: activations are ``[..., seq, hidden]`` (``[batch, seq, hidden]`` or ``[seq, hidden]``);
# the sequence dim is always dim -2. Under sequence parallel (SP) rank r of P holds rows
# ``r*s/P .. (r+1)*s/P`` of the sequence between TP regions.
#
# Column (weight [out/P, in], the local shard):
#   fwd  SP: y = all_gather_seq(x) @ W^T     -> ring: chunk c multiplied while chunk c+1 travels
#        no SP: y = x @ W^T                  (input replicated; identity forward)
#   bwd  SP: dW = dy^T @ all_gather_seq(x)   -> x re-gathered chunk by chunk in backward (the full
#                                               gathered input is never saved), dW GEMM per chunk
#            dx = reduce_scatter_seq(dy @ W) -> ring: partial for chunk c+1 computed while c travels
#        no SP: dx = all_reduce(dy @ W)      -> started async, hidden behind the dW GEMM
# Row (weight [out, in/P]):
#   fwd  SP: y = reduce_scatter_seq(x @ W^T) -> ring, as above;   no SP: y = all_reduce(x @ W^T)
#   bwd  SP: dy gathered chunk by chunk; per chunk dx_c = dy_c @ W and dW += dy_c^T x_c
#        no SP: dx = dy @ W, dW = dy^T x (dy is replicated)
#
# Several column weights can share one gathered input (q/k/v, gate/up): the function takes a list
# of (weight, bias) pairs, so their input is gathered once, forward and backward.
#
# Below ``overlap_min_numel`` (elements of the gathered activation) the plain collective runs
# first and one GEMM follows: for small tensors the per-chunk launch and P2P latency cost more
# than they hide. ``overlap=False`` always takes the plain path.
# ==============================================================================================
# 4 Mi elements (e.g. 1024 tokens x 4096 hidden): below this the chunks are too small to hide
# the transfer latency behind a GEMM on an H100.
DEFAULT_OVERLAP_MIN_NUMEL = 1 << 22


@dataclass
class TPMatmulConfig:
    """Everything a TP matmul needs besides tensors; one per layer (or per fused group)."""

    tp: TPGroup
    sequence_parallel: bool
    overlap: bool
    overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL
    name: str = "tp_linear"  # key of this layer in overlap_report()
    fp8: str = "none"  # train.fp8: every GEMM below runs in FP8 (xorl_kernels/fp8/linear.py), chunks too

    @property
    def stats(self) -> LayerCommStats:
        return self.tp.layer_stats(self.name)

    @property
    def sequence_sharded(self) -> bool:
        return self.sequence_parallel and self.tp.size > 1

    def use_ring(self, gathered_numel: int) -> bool:
        return self.overlap and self.tp.size > 1 and gathered_numel >= self.overlap_min_numel


# -- small GEMM helpers ---------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [tokens, n] (a view when possible)."""
    return t.reshape(-1, t.shape[-1])


def _linear(fp8: str, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """a @ w^T (+ b); in FP8 when ``fp8`` names a recipe. Under the ring paths each chunk is
    quantised on its own (its own scales), which is still the recipe's formula on that chunk."""
    if fp8 == "none":
        return F.linear(a, w, b)
    from xorl_kernels.fp8.linear import linear_forward

    y = linear_forward(_rows(a), w, fp8).view(*a.shape[:-1], w.shape[0])
    return y if b is None else y.add_(b)


def _dgrad(fp8: str, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """g @ w (the input gradient of a linear); in FP8 when ``fp8`` names a recipe."""
    if fp8 == "none":
        return g @ w
    from xorl_kernels.fp8.linear import linear_dgrad

    return linear_dgrad(_rows(g), w, fp8).view(*g.shape[:-1], w.shape[1])


def _linear_into(dst: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 fp8: str = "none") -> None:
    """dst = a @ w^T (+ b), written in place (dst is a slice of a preallocated output)."""
    if fp8 != "none":
        dst.copy_(_linear(fp8, a, w, b))
    elif dst.is_contiguous():
        out = dst.view(-1, dst.shape[-1])
        if b is None:
            torch.mm(_rows(a), w.t(), out=out)
        else:
            torch.addmm(b, _rows(a), w.t(), out=out)
    else:  # [batch>1, seq-slice, n]: rows are strided, write through a temporary
        dst.copy_(F.linear(a, w, b))


def _mm_into(dst: torch.Tensor, a: torch.Tensor, w: torch.Tensor, fp8: str = "none") -> None:
    """dst = a @ w (dx of a linear), in place."""
    if fp8 != "none":
        dst.copy_(_dgrad(fp8, a, w))
    elif dst.is_contiguous():
        torch.mm(_rows(a), w, out=dst.view(-1, dst.shape[-1]))
    else:
        dst.copy_(a @ w)


def _accumulate_wgrad(acc: torch.Tensor | None, grad_out: torch.Tensor, inp: torch.Tensor,
                      fp8: str = "none") -> torch.Tensor:
    """acc += grad_out^T @ inp over all tokens; one fp32 buffer for 16-bit weights.

    Why one buffer: the chunked paths call this once per sequence chunk, and a 16-bit GEMM result
    added afterwards would be a temporary the size of the whole weight shard per chunk. On CUDA
    the GEMM accumulates straight into the fp32 buffer (``out_dtype``); elsewhere (CPU, where
    weights are fp32 anyway, or a torch without it) the 16-bit product is added.
    """
    g, x = _rows(grad_out), _rows(inp)
    if fp8 != "none":  # the FP8 GEMM returns float32 already
        from xorl_kernels.fp8.linear import linear_wgrad

        partial = linear_wgrad(g, x, fp8)
        return partial if acc is None else acc.add_(partial)
    wide = g.dtype in (torch.bfloat16, torch.float16)
    if not wide:
        return g.t() @ x if acc is None else acc.addmm_(g.t(), x)
    if g.is_cuda and _fp32_accumulating_gemm():
        if acc is None:
            return torch.mm(g.t(), x, out_dtype=torch.float32)
        return torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
    partial = (g.t() @ x).float()
    return partial if acc is None else acc.add_(partial)


_FP32_GEMM: dict[str, bool] = {}


def _fp32_accumulating_gemm() -> bool:
    """Whether this torch has mm / addmm with ``out_dtype`` (16-bit inputs, fp32 result) on CUDA."""
    if "cuda" not in _FP32_GEMM:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
            torch.addmm(torch.zeros(2, 2, device="cuda"), a, a, out_dtype=torch.float32)
            _FP32_GEMM["cuda"] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_GEMM["cuda"] = False
    return _FP32_GEMM["cuda"]


def _bias_grad(grad_out: torch.Tensor) -> torch.Tensor:
    return grad_out.sum(dim=tuple(range(grad_out.dim() - 1)))


# -- column: (all-gather ->) matmul ---------------------------------------------------------------

class ColumnParallelMatmul(torch.autograd.Function):
    """outputs_j = gather_seq(x) @ W_j^T + b_j for every (W_j, b_j); see the module docstring."""

    @staticmethod
    def forward(ctx, cfg: TPMatmulConfig, x: torch.Tensor, *params):
        weights, biases = params[0::2], params[1::2]
        tp, stats = cfg.tp, cfg.stats
        chunked = False
        if cfg.sequence_sharded:
            shard = x.shape[-2]
            chunked = cfg.use_ring(x.numel() * tp.size)
            if chunked:
                outs = [x.new_empty(*x.shape[:-2], shard * tp.size, w.shape[0]) for w in weights]

                def consume(chunk: torch.Tensor, src: int) -> None:
                    for out, w, b in zip(outs, weights, biases):
                        _linear_into(out.narrow(-2, src * shard, shard), chunk, w, b, cfg.fp8)

                ring_all_gather(x, tp, consume, stats)
            else:
                gathered = all_gather_sequence(x, tp, stats)
                outs = [_linear(cfg.fp8, gathered, w, b) for w, b in zip(weights, biases)]
        else:
            outs = [_linear(cfg.fp8, x, w, b) for w, b in zip(weights, biases)]
        ctx.cfg, ctx.chunked = cfg, chunked
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        cfg, tp, stats = ctx.cfg, ctx.cfg.tp, ctx.cfg.stats
        x, *weights = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        need_dx = ctx.needs_input_grad[1]
        need_dw = [ctx.needs_input_grad[2 + 2 * j] for j in range(len(weights))]
        dws: list[torch.Tensor | None] = [None] * len(weights)
        dx = None

        def input_grad(start: int = 0, length: int | None = None) -> torch.Tensor:
            """sum_j dy_j @ W_j over sequence rows start .. start+length (all rows by default)."""
            total = None
            for g, w in zip(grads, weights):
                part = _dgrad(cfg.fp8, g if length is None else g.narrow(-2, start, length), w)
                total = part if total is None else total.add_(part)
            return total

        if cfg.sequence_sharded:
            shard = x.shape[-2]
            if ctx.chunked:
                if any(need_dw):
                    def consume(chunk: torch.Tensor, src: int) -> None:
                        for j, g in enumerate(grads):
                            if need_dw[j]:
                                dws[j] = _accumulate_wgrad(dws[j], g.narrow(-2, src * shard, shard), chunk,
                                                           cfg.fp8)

                    ring_all_gather(x, tp, consume, stats)
                if need_dx:
                    dx = ring_reduce_scatter(lambda c: input_grad(c * shard, shard), tp, stats)
            else:
                if any(need_dw):
                    gathered = all_gather_sequence(x, tp, stats)
                    dws = [_accumulate_wgrad(None, g, gathered, cfg.fp8) if need else None
                           for g, need in zip(grads, need_dw)]
                if need_dx:
                    dx = reduce_scatter_sequence(input_grad(), tp, stats)
        else:
            work = None
            if need_dx:
                dx = input_grad()
                if tp.size > 1:  # replicated input: every rank's dx is a partial sum
                    work = all_reduce_async(dx, tp, stats)
            dws = [_accumulate_wgrad(None, g, x, cfg.fp8) if need else None for g, need in zip(grads, need_dw)]
            if work is not None:
                wait_all([work], stats, dx.is_cuda)
        result = [None, dx]
        for j, (w, g) in enumerate(zip(weights, grads)):
            result.append(dws[j].to(w.dtype) if dws[j] is not None else None)
            result.append(_bias_grad(g) if ctx.has_bias[j] and ctx.needs_input_grad[3 + 2 * j] else None)
        return tuple(result)


# -- row: matmul (-> reduce-scatter) --------------------------------------------------------------

class RowParallelMatmul(torch.autograd.Function):
    """y = reduce_scatter_seq(x @ W^T) + b (SP) or all_reduce(x @ W^T) + b; see the module docstring."""

    @staticmethod
    def forward(ctx, cfg: TPMatmulConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        tp, stats = cfg.tp, cfg.stats
        chunked = False
        if cfg.sequence_sharded:
            shard = check_sequence_divisible(x.shape[-2], tp, f"{cfg.name} (RowParallelLinear input)")
            chunked = cfg.use_ring(x.numel() // x.shape[-1] * weight.shape[0])
            if chunked:
                y = ring_reduce_scatter(
                    lambda c: _linear(cfg.fp8, x.narrow(-2, c * shard, shard), weight), tp, stats
                )
            else:
                y = reduce_scatter_sequence(_linear(cfg.fp8, x, weight), tp, stats)
        else:
            y = _linear(cfg.fp8, x, weight)
            if tp.size > 1:
                wait_all([all_reduce_async(y, tp, stats)], stats, y.is_cuda)
        if bias is not None:
            y += bias
        ctx.cfg, ctx.chunked, ctx.has_bias = cfg, chunked, bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        cfg, tp, stats = ctx.cfg, ctx.cfg.tp, ctx.cfg.stats
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_db = ctx.has_bias and ctx.needs_input_grad[3]
        dx = dw = db = None
        bias_work = None
        if need_db:
            db = _bias_grad(grad_out)
            if cfg.sequence_sharded:  # each rank summed only its own tokens
                bias_work = all_reduce_async(db, tp, stats)
        if cfg.sequence_sharded:
            shard = x.shape[-2] // tp.size
            if ctx.chunked:
                dx = x.new_empty(x.shape) if need_dx else None

                def consume(chunk: torch.Tensor, src: int) -> None:
                    nonlocal dw
                    if need_dx:
                        _mm_into(dx.narrow(-2, src * shard, shard), chunk, weight, cfg.fp8)
                    if need_dw:
                        dw = _accumulate_wgrad(dw, chunk, x.narrow(-2, src * shard, shard), cfg.fp8)

                ring_all_gather(grad_out, tp, consume, stats)
            else:
                gathered = all_gather_sequence(grad_out, tp, stats)
                dx = _dgrad(cfg.fp8, gathered, weight) if need_dx else None
                dw = _accumulate_wgrad(None, gathered, x, cfg.fp8) if need_dw else None
        else:
            dx = _dgrad(cfg.fp8, grad_out, weight) if need_dx else None
            dw = _accumulate_wgrad(None, grad_out, x, cfg.fp8) if need_dw else None
        if bias_work is not None:
            wait_all([bias_work], stats, db.is_cuda)
        return None, dx, dw.to(weight.dtype) if dw is not None else None, db
