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
