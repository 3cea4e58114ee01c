"""Building blocks shared by the models: rotary position embedding, SwiGLU MLP (RMSNorm: xorl/nn/rms_norm.py).

The arithmetic follows transformers' Llama / Qwen3-MoE code step by step (same dtypes, same order
of operations) so fp32 logits agree to ~1e-6 relative. Each runs as one fused op of xorl_kernels
(apply_rotary, swiglu): Triton kernels on the GPU, the same arithmetic in plain torch on the CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xorl.nn.linear import Linear
from xorl.nn.lora import lora_spec
from xorl_kernels.activation.op import swiglu
from xorl_kernels.rope.op import apply_rotary as _rope


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit position ids, for the spec's rotary dims and RoPE scaling.

    Why no buffer: the inverse frequencies are a [rotary_dim/2] vector kept as a plain CPU tensor
    (copied to the positions' device once per device), so the module has no state to materialise
    after building on the meta device, and positions can be anything (context-parallel shards,
    packed documents restarting at 0): a scaled RoPE (llama3 / linear / yarn) is a function of the
    position alone, so every shard computes its own rows of the same table.
    Scaled variants take their inverse frequencies and cos/sin factor from transformers'
    ROPE_INIT_FUNCTIONS (the reference implementation) rather than re-deriving them.
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict | None = None, rotary_dim: int | None = None,
                 max_position_embeddings: int = 2048):
        super().__init__()
        self.head_dim = rotary_dim or head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        if rope_scaling:
            self.inv_freq, self.attention_scaling = scaled_inv_freq(
                head_dim, self.head_dim, theta, rope_scaling, max_position_embeddings)
        else:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu")
            self.inv_freq = 1.0 / (theta ** (exponents.float() / self.head_dim))
            self.attention_scaling = 1.0
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [batch, seq] -> (cos, sin), each [batch, seq, rotary_dim] in ``dtype``."""
        device = position_ids.device
        inv_freq = self._on_device.get(device)
        if inv_freq is None:
            inv_freq = self._on_device[device] = self.inv_freq.to(device)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling != 1.0:
            return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.head_dim}, theta={self.theta}, scaling={self.rope_scaling}"


def scaled_inv_freq(head_dim: int, rotary_dim: int, theta: float, rope_scaling: dict,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] on CPU, cos/sin factor) from transformers' ROPE_INIT_FUNCTIONS."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**rope_scaling, "rope_theta": theta}
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    # Any PreTrainedConfig with these attributes serves: the functions read only them.
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rope_parameters=params)
    with torch.device("cpu"):  # also when the model is built under torch.device("meta")
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def yarn_softmax_mscale(rope_scaling: dict | None) -> float:
    """The factor on MLA's softmax scale: yarn_get_mscale(factor, mscale_all_dim)^2 when the RoPE is
    scaled and names mscale_all_dim, else 1 (transformers' DeepseekV3 ``yarn_apply_mscale``; the cos /
    sin side of YaRN, mscale / mscale_all_dim, comes with the tables from ROPE_INIT_FUNCTIONS)."""
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim") or 0
    factor = (rope_scaling or {}).get("factor") or 1.0
    if not mscale_all_dim or factor <= 1:
        return 1.0
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return mscale * mscale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]; cos/sin [batch, seq, rot <= head_dim] (HF's "rotate half" layout;
    rot < head_dim: partial rotary)."""
    return _rope(x, cos, sin)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with HF parameter names.

    ``merge_gate_up``: one ``gate_up_proj`` [2 * intermediate, hidden] whose rows alternate gate and
    up (row 2i: gate unit i, row 2i + 1: up unit i). Why interleaved: tensor parallelism splits the
    intermediate units over the ranks, and any contiguous block of rows then holds matching gate and
    up units, whatever the TP size (a checkpoint resumes on any TP), so each rank runs one GEMM for
    both. HF files keep gate_proj / up_proj (xorl/models/hf_reader.py converts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, merge_gate_up: bool = False,
                 fp8: str = "none", lora: dict | None = None):
        super().__init__()
        self.merge_gate_up = merge_gate_up
        if merge_gate_up:
            self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, fp8=fp8)
        else:
            self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, fp8=fp8,
                                    lora=lora_spec(lora, "gate_proj"))
            self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, fp8=fp8, lora=lora_spec(lora, "up_proj"))
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, fp8=fp8, lora=lora_spec(lora, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merge_gate_up:  # [..., units (this rank's under TP), 2]: gate, up
            gate_up = self.gate_up_proj(x)
            gate_up = gate_up.view(*gate_up.shape[:-1], -1, 2)
            return self.down_proj(swiglu(gate_up[..., 0], gate_up[..., 1]))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
