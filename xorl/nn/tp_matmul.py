"""The overlapped TP matmuls: the forward and backward math of ColumnParallelLinear /
RowParallelLinear (xorl/nn/tensor_parallel.py), built on the ring and plain collectives of
xorl/nn/tp_comm.py. The dispatcher ops (with autograd) that run them: xorl/nn/tp_linear_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from xorl.nn.tp_comm import (
    DEFAULT_OVERLAP_MIN_NUMEL,
    LayerCommStats,
    TPGroup,
    all_gather_sequence,
    all_reduce_async,
    check_sequence_divisible,
    reduce_scatter_sequence,
    ring_all_gather,
    ring_reduce_scatter,
    wait_all,
)

# The TP linears' math: all-gather→matmul and matmul→reduce-scatter, chunked.
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
# of (weight, bias) pairs, so their input is gathered once, forward and backward. Under train.fp8 that
# input is cast once, on its shard, and gathered in float8 (xorl/nn/tp_fp8.py); every GEMM is FP8, the
# weights cast once per call (not per ring chunk).
#
# Below ``overlap_min_numel`` (elements of the gathered activation) the plain collective runs
# first and one GEMM follows: for small tensors the per-chunk launch and P2P latency cost more
# than they hide. ``overlap=False`` always takes the plain path.


@dataclass
class TPMatmulConfig:
    """Everything a TP matmul needs besides tensors; one per layer (or per fused group)."""

    tp: TPGroup
    sequence_parallel: bool
    overlap: bool
    overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL
    name: str = "tp_linear"  # key of this layer in overlap_report()
    fp8: str = "none"  # train.fp8: every GEMM below runs in FP8 (xorl_kernels/fp8/linear.py), chunks too
    # The config a compiled block's op takes in this layer's place: one per TP group and settings,
    # set when the layer is built (xorl/nn/tp_linear_ops.py with_compiled_twin).
    compiled: TPMatmulConfig | None = field(default=None, repr=False, compare=False)

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


def _fp8_weights(fp8: str, weights, role: str) -> list:
    """Each weight cast once as FP8 operand ``role`` ("w" forward, "w_t" dgrad), shared by the ring's
    chunks; Nones without FP8."""
    if fp8 == "none":
        return [None] * len(weights)
    from xorl.nn import tp_fp8

    return [tp_fp8.weight(w, fp8, role) for w in weights]


def _linear(fp8: str, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, w8=None) -> torch.Tensor:
    """a @ w^T (+ b); in FP8 when ``fp8`` names a recipe (``w8``: w's FP8 operand, _fp8_weights). Under
    the ring paths each chunk is quantised on its own (its own scales): the recipe's formula on that chunk."""
    if fp8 == "none":
        return F.linear(a, w, b)
    from xorl.nn import tp_fp8

    return tp_fp8.linear(a, fp8, w8 or tp_fp8.weight(w, fp8, "w"), b, w.shape[0])


def _dgrad(fp8: str, g: torch.Tensor, w: torch.Tensor, w8=None) -> torch.Tensor:
    """g @ w (the input gradient of a linear); in FP8 when ``fp8`` names a recipe (``w8``: w^T's operand)."""
    if fp8 == "none":
        return g @ w
    from xorl.nn import tp_fp8

    return tp_fp8.dgrad(g, fp8, w8 or tp_fp8.weight(w, fp8, "w_t"), w.shape[1])


def _linear_into(dst: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """dst = a @ w^T (+ b), written in place (dst is a slice of a preallocated output)."""
    if dst.is_contiguous():
        out = dst.view(-1, dst.shape[-1])
        if b is None:
            torch.mm(_rows(a), w.t(), out=out)
        else:
            torch.addmm(b, _rows(a), w.t(), out=out)
    else:  # [batch>1, seq-slice, n]: rows are strided, write through a temporary
        dst.copy_(F.linear(a, w, b))


def _mm_into(dst: torch.Tensor, a: torch.Tensor, w: torch.Tensor, fp8: str = "none", w8=None) -> None:
    """dst = a @ w (dx of a linear), in place."""
    if fp8 != "none":
        dst.copy_(_dgrad(fp8, a, w, w8))
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


def bias_grad(grad_out: torch.Tensor) -> torch.Tensor:
    """A bias's gradient: the output gradient summed over every token (all dims but the last)."""
    return grad_out.sum(dim=tuple(range(grad_out.dim() - 1)))


# -- column: (all-gather ->) matmul ---------------------------------------------------------------
# Plain functions of tensors (no autograd here): xorl/nn/tp_linear_ops.py makes each forward and
# each backward one dispatcher op (so selective checkpointing keeps a TP linear's output whole).

def column_chunked(cfg: TPMatmulConfig, x: torch.Tensor) -> bool:
    """Whether the column layer on input ``x`` (this rank's shard) takes the ring path."""
    return cfg.sequence_sharded and cfg.use_ring(x.numel() * cfg.tp.size)


def column_forward(cfg: TPMatmulConfig, x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """outputs_j = gather_seq(x) @ W_j^T + b_j for every (W_j, b_j); see the module docstring."""
    tp, stats = cfg.tp, cfg.stats
    if cfg.fp8 != "none":  # the input cast once on its shard, gathered in float8 (xorl/nn/tp_fp8.py)
        from xorl.nn import tp_fp8

        return tp_fp8.column_forward(cfg, x, weights, biases, column_chunked(cfg, x))
    if not cfg.sequence_sharded:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    shard = x.shape[-2]
    if not column_chunked(cfg, x):
        gathered = all_gather_sequence(x, tp, stats)
        return [F.linear(gathered, w, b) for w, b in zip(weights, biases)]
    outs = [x.new_empty(*x.shape[:-2], shard * tp.size, w.shape[0]) for w in weights]

    def consume(chunk: torch.Tensor, src: int) -> None:
        for out, w, b in zip(outs, weights, biases):
            _linear_into(out.narrow(-2, src * shard, shard), chunk, w, b)

    ring_all_gather(x, tp, consume, stats)
    return outs


def column_backward(cfg: TPMatmulConfig, x: torch.Tensor, weights, grads, need_dx: bool, need_dw: list[bool]):
    """(dx or None, [dW_j or None]) of ``column_forward`` (weight gradients in the weights' dtype)."""
    tp, stats = cfg.tp, cfg.stats
    grads = [g.contiguous() for g in grads]
    dws: list[torch.Tensor | None] = [None] * len(weights)
    dx = None
    w8s = _fp8_weights(cfg.fp8, weights, "w_t") if need_dx else [None] * len(weights)

    def input_grad(start: int = 0, length: int | None = None) -> torch.Tensor:
        """sum_j dy_j @ W_j over sequence rows start .. start+length (all rows by default)."""
        total = None
        for g, w, w8 in zip(grads, weights, w8s):
            part = _dgrad(cfg.fp8, g if length is None else g.narrow(-2, start, length), w, w8)
            total = part if total is None else total.add_(part)
        return total

    if cfg.fp8 != "none" and any(need_dw):  # x^T cast once on its shard (xorl/nn/tp_fp8.py)
        from xorl.nn import tp_fp8

        dws = tp_fp8.column_wgrads(cfg, x, grads, need_dw, column_chunked(cfg, x))
        need_dw = [False] * len(weights)
    if cfg.sequence_sharded:
        shard = x.shape[-2]
        if column_chunked(cfg, x):
            if any(need_dw):
                def consume(chunk: torch.Tensor, src: int) -> None:
                    for j, g in enumerate(grads):
                        if need_dw[j]:
                            dws[j] = _accumulate_wgrad(dws[j], g.narrow(-2, src * shard, shard), chunk)

                ring_all_gather(x, tp, consume, stats)
            if need_dx:
                dx = ring_reduce_scatter(lambda c: input_grad(c * shard, shard), tp, stats)
        else:
            if any(need_dw):
                gathered = all_gather_sequence(x, tp, stats)
                dws = [_accumulate_wgrad(None, g, gathered) if need else None for g, need in zip(grads, need_dw)]
            if need_dx:
                dx = reduce_scatter_sequence(input_grad(), tp, stats)
    else:
        work = None
        if need_dx:
            dx = input_grad()
            if tp.size > 1:  # replicated input: every rank's dx is a partial sum
                work = all_reduce_async(dx, tp, stats)
        if any(need_dw):
            dws = [_accumulate_wgrad(None, g, x) if need else None for g, need in zip(grads, need_dw)]
        if work is not None:
            wait_all([work], stats, dx.is_cuda)
    return dx, [dw.to(w.dtype) if dw is not None else None for dw, w in zip(dws, weights)]


# -- row: matmul (-> reduce-scatter) --------------------------------------------------------------

def row_chunked(cfg: TPMatmulConfig, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the row layer on input ``x`` takes the ring path (checks the sequence divides)."""
    if not cfg.sequence_sharded:
        return False
    check_sequence_divisible(x.shape[-2], cfg.tp, f"{cfg.name} (RowParallelLinear input)")
    return cfg.use_ring(x.numel() // x.shape[-1] * weight.shape[0])


def row_forward(cfg: TPMatmulConfig, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """y = reduce_scatter_seq(x @ W^T) + b (SP) or all_reduce(x @ W^T) + b; see the module docstring."""
    tp, stats = cfg.tp, cfg.stats
    if row_chunked(cfg, x, weight):
        shard = x.shape[-2] // tp.size
        (w8,) = _fp8_weights(cfg.fp8, [weight], "w")
        y = ring_reduce_scatter(lambda c: _linear(cfg.fp8, x.narrow(-2, c * shard, shard), weight, None, w8), tp,
                                stats)
    elif cfg.sequence_sharded:
        y = reduce_scatter_sequence(_linear(cfg.fp8, x, weight), tp, stats)
    else:
        y = _linear(cfg.fp8, x, weight)
        if tp.size > 1:
            wait_all([all_reduce_async(y, tp, stats)], stats, y.is_cuda)
    if bias is not None:
        y += bias
    return y


def row_backward(cfg: TPMatmulConfig, x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                 need_dx: bool, need_dw: bool, need_db: bool):
    """(dx, dW, db), each None where not needed, of ``row_forward``."""
    tp, stats = cfg.tp, cfg.stats
    grad_out = grad_out.contiguous()
    dx = dw = db = None
    bias_work = None
    if need_db:
        db = bias_grad(grad_out)
        if cfg.sequence_sharded:  # each rank summed only its own tokens
            bias_work = all_reduce_async(db, tp, stats)
    if cfg.sequence_sharded:
        shard = x.shape[-2] // tp.size
        if row_chunked(cfg, x, weight):
            dx = x.new_empty(x.shape) if need_dx else None
            (w8,) = _fp8_weights(cfg.fp8, [weight], "w_t") if need_dx else (None,)

            def consume(chunk: torch.Tensor, src: int) -> None:
                nonlocal dw
                if need_dx:
                    _mm_into(dx.narrow(-2, src * shard, shard), chunk, weight, cfg.fp8, w8)
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
    return dx, dw.to(weight.dtype) if dw is not None else None, db

