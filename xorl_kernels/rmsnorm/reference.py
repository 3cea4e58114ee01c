"""Plain-torch RMSNorm, step by step as transformers' LlamaRMSNorm (the CPU path), and its backward.

Forward: ``y = weight * (x32 * rstd).to(x.dtype)`` with ``x32 = x.float()`` and
``rstd = 1 / sqrt(mean(x32**2) + eps)`` over the last dim. Backward (``x_hat = x32 * rstd``):
``dx = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = dy * weight``, ``dweight = sum(dy * x_hat)``
over every row.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(y, rstd [rows] fp32)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd.squeeze(-1)


def rms_norm_backward_reference(dy, x, weight, rstd):
    """(dx in x's dtype, dweight in weight's dtype)."""
    x32, rstd = x.float(), rstd.unsqueeze(-1)
    x_hat = x32 * rstd
    g = dy.float() * weight.float()
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dw = (dy.float() * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)
