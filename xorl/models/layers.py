"""Building blocks shared by the models: RMSNorm, rotary position embedding, SwiGLU MLP.

The arithmetic follows transformers' Llama / Qwen3-MoE code step by step (same dtypes, same order
of operations) so fp32 logits agree to ~1e-6 relative. Each runs as one fused op of xorl_kernels
(rms_norm with its residual add, apply_rotary, swiglu): Triton kernels on the GPU, the same
arithmetic in plain torch on the CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from xorl.nn.linear import Linear
from xorl.nn.lora import lora_spec
from xorl.nn.tp_comm import LayerCommStats, TPGroup, all_reduce_async, wait_all
from xorl_kernels.activation.op import swiglu
from xorl_kernels.rmsnorm.op import rms_norm
from xorl_kernels.rope.op import apply_rotary as _rope


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalisation runs in fp32, as in HF."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def init_weights(self, std: float) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with ``residual``: (RMSNorm(x + residual), x + residual) in one fused pass."""
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


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


class WidthRMSNorm(RMSNorm):
    """RMSNorm over a whole q or k projection, every head of the token at once (OLMoE's q_norm /
    k_norm), that can run on a tensor-parallel shard of the heads.

    Under tensor parallelism (``shard_over_tp``) a rank holds a contiguous block of the heads, so
    of the projection's width; its weight becomes the matching ``Shard(0)`` block (like the
    projection rows it scales, and like gpt-oss's per-head sinks). Each rank normalises its columns
    with the whole width's mean square: one all-reduce of a [tokens, 1] fp32 buffer forward, one
    backward (``_WidthRMSNormOverTP``, through tp_comm's all-reduce, recorded in its comm report).
    Without TP it is the fused rms_norm op.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        self.width = dim
        self.tp: TPGroup | None = None
        self.comm_stats: LayerCommStats | None = None

    def shard_over_tp(self, tp: TPGroup, tp_mesh, name: str = "width_rms_norm") -> None:
        """Keep this rank's block of the weight (a ``Shard(0)`` DTensor on ``tp_mesh``): the tensor-parallel
        plan has split the projection this norm follows into ``tp.size`` contiguous blocks of heads.
        ``name``: this norm's entry in the TP communication record (tp_comm.overlap_report)."""
        if self.width % tp.size:
            raise ValueError(f"WidthRMSNorm: width {self.width} is not divisible by tensor_parallel_size={tp.size}")
        weight = self.weight
        local = weight.detach().chunk(tp.size)[tp.rank].clone()
        self.weight = nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False),
                                   requires_grad=weight.requires_grad)
        self.tp, self.comm_stats = tp, tp.layer_stats(name)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.tp is None:
            return super().forward(x, residual)
        if residual is not None:
            raise ValueError("WidthRMSNorm under tensor parallelism takes no residual (it normalises q / k)")
        if x.shape[-1] * self.tp.size != self.width:
            raise ValueError(f"WidthRMSNorm: this rank's input has {x.shape[-1]} columns, expected "
                             f"{self.width} / tensor_parallel_size={self.tp.size}")
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return _WidthRMSNormOverTP.apply(x, weight, self.eps, self.width, self.tp, self.comm_stats)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp.size}" if self.tp is not None else ""
        return f"{self.width}, eps={self.eps}{tp}"


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
