"""Plain-torch SwiGLU activation ``silu(gate) * up`` (transformers' order: silu in the input dtype,
then the product) and its backward, with ``s = sigmoid(gate)``:
``dgate = dy * up * s * (1 + gate * (1 - s))``, ``dup = dy * gate * s``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_backward_reference(dy, gate, up):
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dgate = d * u * s * (1 + g * (1 - s))
    dup = d * g * s
    return dgate.to(gate.dtype), dup.to(up.dtype)


def clamped_swiglu_reference(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate, same ops and order):
    gate clamped above at ``limit``, up to [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)``.
    Differentiable by autograd (the clamps pass no gradient where they cut)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
