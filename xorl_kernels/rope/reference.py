"""Plain-torch rotary embedding in transformers' "rotate half" layout (the CPU path).

``x`` [batch, seq, heads, head_dim], ``cos`` / ``sin`` [batch, seq, rot] (rot <= head_dim, even):
the first ``rot`` dims of each head are rotated, ``x1`` = its first half, ``x2`` the second:
``out = x * cos + cat(-x2, x1) * sin``; dims past ``rot`` (partial rotary) pass unchanged. Every
scaled variant (linear, llama3, yarn, ...) is in the caller's cos / sin (yarn's attention factor
included), so one kernel serves all. Backward (cos / sin are constants of the positions):
``dx1 = dy1 * cos1 + dy2 * sin2``, ``dx2 = dy2 * cos2 - dy1 * sin1``.
"""

from __future__ import annotations

import torch


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if rot == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat(((head * cos) + (_rotate_half(head) * sin), tail), dim=-1)


def rope_backward_reference(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    half = rot // 2
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    d1, d2 = dy[..., :half], dy[..., half:rot]
    dx1 = d1 * cos[..., :half] + d2 * sin[..., half:]
    dx2 = d2 * cos[..., half:] - d1 * sin[..., :half]
    return torch.cat((dx1, dx2, dy[..., rot:]), dim=-1)
