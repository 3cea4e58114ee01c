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


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """(y, rstd [rows] fp32) of transformers' Qwen3NextRMSNormGated / Qwen3_5RMSNormGated, rounding
    for rounding: ``(weight * (x32 * rstd).to(x.dtype)) * silu(gate.float())`` cast to x's dtype."""
    x32 = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * (x32 * rstd).to(x.dtype)
    gate32 = gate.float() if gate.dtype != torch.float64 else gate
    return (normed * torch.nn.functional.silu(gate32)).to(x.dtype), rstd.squeeze(-1)


def gated_rms_norm_backward_reference(dy, x, gate, weight, rstd):
    """(dx, dgate, dweight) in the inputs' dtypes; with n = x̂ * weight and s = silu(gate):
    dweight = sum(dy s x̂), dx = rstd (g - x̂ mean(g x̂)) for g = dy s weight,
    dgate = dy n σ(gate)(1 + gate (1 - σ(gate)))."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    x32, rstd, z, dy = x.to(f), rstd.to(f).unsqueeze(-1), gate.to(f), dy.to(f)
    x_hat = x32 * rstd
    sig = torch.sigmoid(z)
    d_normed = dy * z * sig
    g = d_normed * weight.to(f)
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dw = (d_normed * x_hat).reshape(-1, x.shape[-1]).sum(0)
    dz = dy * x_hat * weight.to(f) * sig * (1 + z * (1 - sig))
    return dx.to(x.dtype), dz.to(gate.dtype), dw.to(weight.dtype)
