"""Building blocks shared by the models: RMSNorm, rotary position embedding, SwiGLU MLP.

The arithmetic follows transformers' Llama / Qwen3-MoE code step by step (same dtypes, same order
of operations) so fp32 logits agree to ~1e-6 relative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xorl.nn.linear import Linear


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalisation runs in fp32, as in HF."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def init_weights(self, std: float) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit position ids.

    Why no buffer: the inverse frequencies are recomputed per call (a [head_dim/2] vector), so the
    module has no state to materialise after building on the meta device, and positions can be
    anything (context-parallel shards, packed documents restarting at 0).
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [batch, seq] -> (cos, sin), each [batch, seq, head_dim] in ``dtype``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=position_ids.device)
        inv_freq = 1.0 / (self.theta ** (exponents.float() / self.head_dim))
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]; cos/sin [batch, seq, head_dim] (HF's "rotate half" layout)."""
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    return (x * cos) + (rotate_half(x) * sin)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with HF parameter names.

    ``merge_gate_up``: one ``gate_up_proj`` [2 * intermediate, hidden] whose rows alternate gate and
    up (row 2i: gate unit i, row 2i + 1: up unit i). Why interleaved: tensor parallelism splits the
    intermediate units over the ranks, and any contiguous block of rows then holds matching gate and
    up units, whatever the TP size (a checkpoint resumes on any TP), so each rank runs one GEMM for
    both. HF files keep gate_proj / up_proj (xorl/models/hf_io.py converts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, merge_gate_up: bool = False,
                 fp8: str = "none"):
        super().__init__()
        self.merge_gate_up = merge_gate_up
        if merge_gate_up:
            self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, fp8=fp8)
        else:
            self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, fp8=fp8)
            self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, fp8=fp8)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merge_gate_up:  # [..., units (this rank's under TP), 2]: gate, up
            gate_up = self.gate_up_proj(x)
            gate_up = gate_up.view(*gate_up.shape[:-1], -1, 2)
            return self.down_proj(F.silu(gate_up[..., 0]) * gate_up[..., 1])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
