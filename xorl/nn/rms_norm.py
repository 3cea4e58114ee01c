"""``RMSNorm``: y = weight * (x / sqrt(mean(x^2) + eps)), as one fused op of xorl_kernels.

The normalisation runs in fp32, as in transformers' Llama / Qwen3-MoE RMSNorm (same dtypes, same order
of operations). With ``residual`` it adds the residual first, in the same pass (``rms_norm`` returns
both). A building block of every xorl model (xorl/models); here in ``xorl.nn`` beside ``Linear`` because
its tensor-parallel form over a projection's whole width (xorl/nn/tp_norms.py) is one of it.
"""

from __future__ import annotations

import torch
from torch import nn

from xorl_kernels.rmsnorm.op import rms_norm


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalisation runs in fp32, as in HF."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def init_weights(self, std: float) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with ``residual``: (RMSNorm(x + residual), x + residual) in one fused pass."""
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
