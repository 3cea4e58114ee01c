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


def clamped_swiglu_backward_reference(dy, gate, up, alpha: float, limit: float):
    """(dgate, dup) of ``clamped_swiglu_reference``: with gc = min(gate, l), s = sigmoid(alpha gc),
    dgate = dy (uc + 1) (s + alpha gc s (1 - s)) where gate <= l, dup = dy gc s where |up| <= l."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, d = gate.to(compute), up.to(compute), dy.to(compute)
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    s = torch.sigmoid(alpha * gc)
    glu = gc * s
    dgate = torch.where(g <= limit, d * (uc + 1) * (s + alpha * glu * (1 - s)), 0.0)
    dup = torch.where((u >= -limit) & (u <= limit), d * glu, 0.0)
    return dgate.to(gate.dtype), dup.to(up.dtype)
