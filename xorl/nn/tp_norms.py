"""An RMSNorm over a projection's whole width (OLMoE's q_norm / k_norm: every head of a token at once)
that runs on a tensor-parallel shard of the heads: ``WidthRMSNormOverTP``.

Under tensor parallelism a rank holds a contiguous block of the heads, so of the projection's width;
the norm's weight becomes the matching ``Shard(0)`` block (like the projection rows it scales, and
like gpt-oss's per-head sinks). Each rank normalises its columns with the whole width's mean square:
one all-reduce of a [tokens, 1] fp32 buffer forward, one backward (``_WidthRMSNormOverTP``, through
tp_comm's all-reduce, recorded in its comm report). The TP plan builds it from the model's
``RMSNorm`` (``from_norm``: the layout's ``width_norm`` style, xorl/nn/tp_styles.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from xorl.nn.rms_norm import RMSNorm
from xorl.nn.tp_comm import LayerCommStats, TPGroup, all_reduce_async, wait_all


class _WidthRMSNormOverTP(torch.autograd.Function):
    """RMSNorm of this rank's columns with the whole width's statistics. Forward: the [rows, 1] sums
    of squares (fp32, on x's device) all-reduced over TP. Backward (x_hat = x * rstd, g = dy * weight):
    dx = rstd * (g - x_hat * sum(g * x_hat) / width), whose sum spans the whole width, so the [rows, 1]
    cross term is all-reduced too; dweight = sum over rows of dy * x_hat, this rank's block, exact.
    Saves x and rstd only, as the fused rms_norm op does (the planner counts the same bytes)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, width: int, tp: TPGroup, stats: LayerCommStats):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 statistics (float64 stays)
        sum_sq = x32.pow(2).sum(-1, keepdim=True)
        wait_all([all_reduce_async(sum_sq, tp, stats)], stats, x.is_cuda)
        rstd = torch.rsqrt(sum_sq / width + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.width, ctx.tp, ctx.stats = width, tp, stats
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        dy32 = dy.to(rstd.dtype)
        g = dy32 * weight.to(rstd.dtype)
        cross = (g * x_hat).sum(-1, keepdim=True)
        wait_all([all_reduce_async(cross, ctx.tp, ctx.stats)], ctx.stats, dy.is_cuda)
        dx = (rstd * (g - x_hat * (cross / ctx.width))).to(x.dtype)
        dw = (dy32 * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


class WidthRMSNormOverTP(RMSNorm):
    """RMSNorm over ``width`` columns of which this TP rank holds the contiguous block ``tp.rank``:
    its weight is that block of the whole norm's (a ``Shard(0)`` DTensor on ``tp_mesh``), its input
    this rank's [..., width / tp] columns. ``name``: its entry in the TP communication record
    (tp_comm.overlap_report; the plan passes the module path)."""

    def __init__(self, width: int, tp_mesh, eps: float = 1e-6, name: str = "width_rms_norm", *, device=None,
                 dtype=None):
        tp = TPGroup.from_mesh(tp_mesh)
        if width % tp.size:
            raise ValueError(f"WidthRMSNorm: width {width} is not divisible by tensor_parallel_size={tp.size}")
        super().__init__(width // tp.size, eps, device=device, dtype=dtype)
        self.weight = nn.Parameter(DTensor.from_local(self.weight.detach(), tp_mesh, [Shard(0)], run_check=False))
        self.width = width
        self.tp = tp
        self.comm_stats: LayerCommStats = tp.layer_stats(name)

    @classmethod
    def from_norm(cls, norm: RMSNorm, tp_mesh, name: str) -> WidthRMSNormOverTP:
        """This rank's block of ``norm`` (the same weights on every rank; on the meta device nothing is
        copied). The projection the norm follows is split into the same contiguous blocks of heads."""
        weight = norm.weight
        layer = cls(weight.shape[0], tp_mesh, norm.eps, name, device=weight.device, dtype=weight.dtype)
        if weight.device.type != "meta":
            with torch.no_grad():
                layer.weight.to_local().copy_(weight.detach().chunk(layer.tp.size)[layer.tp.rank])
        layer.weight.requires_grad_(weight.requires_grad)
        return layer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            raise ValueError("WidthRMSNorm under tensor parallelism takes no residual (it normalises q / k)")
        if x.shape[-1] * self.tp.size != self.width:
            raise ValueError(f"WidthRMSNorm: this rank's input has {x.shape[-1]} columns, expected "
                             f"{self.width} / tensor_parallel_size={self.tp.size}")
        return _WidthRMSNormOverTP.apply(x, self.weight.to_local(), self.eps, self.width, self.tp, self.comm_stats)

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}, tp={self.tp.size}"
