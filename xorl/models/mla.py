"""Multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi-K2, Moonlight), with transformers' names.

Per token (heads h, HF's DeepseekV3Attention step by step):

    q   = q_proj(x)                                   (q_lora_rank None)
        | q_b_proj(q_a_layernorm(q_a_proj(x)))        [h, qk_nope + qk_rope]
    c, k_rot = kv_a_proj_with_mqa(x)                  [kv_lora_rank], [qk_rope] (one head, all share it)
    k_nope, v = kv_b_proj(kv_a_layernorm(c))          [h, qk_nope], [h, v_head_dim]
    q = [q_nope, rope(q_rot)],  k = [k_nope, rope(k_rot)]   (q.k head dim qk_nope + qk_rope)
    out = o_proj(attention(q, k, v))                  (v narrower than q.k: d_v != d_qk)

RoPE rotates only the qk_rope part, with the tables of ``xorl.models.layers.RotaryEmbedding`` built
for qk_rope_head_dim (YaRN included). DeepSeek lays those dims out in interleaved pairs
(``rope_interleave``; always in DeepSeek-V2): (x0, x1) is one rotation. transformers rotates the even
and odd slices and writes them as halves, which equals de-interleaving (evens, then odds) and the
usual rotate-half RoPE, so that is what runs here; q and k are permuted alike, so q.k is unchanged.
The softmax scale is qk_head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN.

Tensor parallel (the decoder's TP layout, xorl/models/tp_layout.py): q_proj / q_b_proj and kv_b_proj
are column-parallel (whole heads), o_proj row-parallel; the down-projections and their norms stay
replicated (a small latent per token). The shared RoPE key is used by every rank's heads, so it
passes ``rope_key_to_heads``, an ``nn.Identity`` here, where the layout puts the head-parallel
region's entry (xorl/nn/tp_regions.py ``ToHeadParallel``: its gradient summed over TP; under sequence
parallel it is all-gathered along the sequence, as the column layers gather theirs).
"""

from __future__ import annotations

import torch
from torch import nn

from xorl.models.attention import LocalAttention
from xorl.models.layers import apply_rotary, yarn_softmax_mscale
from xorl.models.spec import ModelSpec
from xorl.nn.attention_backends import attention_backend
from xorl.nn.linear import Linear
from xorl.nn.rms_norm import RMSNorm

# transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: DeepSeek's interleaved RoPE
    pairs in the rotate-half layout (transformers' apply_rotary_pos_emb_interleave, bit for bit)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """MLA with HF parameter names (q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj); ``core_attention(q, k, v, cu_seqlens=..., max_seqlen=...)`` is
    the context-parallel plug point, as in ``xorl.models.attention.Attention`` (v has v_head_dim)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        heads = spec.num_attention_heads
        self.num_heads = self.num_key_value_heads = heads  # k and v per head, from the shared latent
        self.qk_nope_head_dim, self.qk_rope_head_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = spec.v_head_dim, spec.kv_lora_rank
        self.head_dim = spec.head_dim  # the q.k head dim: qk_nope + qk_rope
        # DeepSeek-V2 always interleaves (its family fixes rope_interleave).
        self.rope_interleave = spec.rope_interleave
        bias, fp8 = spec.attention_bias, spec.fp8
        if spec.q_lora_rank is None:
            self.q_proj = Linear(spec.hidden_size, heads * self.head_dim, bias=False, fp8=fp8)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(spec.hidden_size, spec.q_lora_rank, bias=bias, fp8=fp8)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(spec.q_lora_rank, heads * self.head_dim, bias=False, fp8=fp8)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
                                         fp8=fp8)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False,
                                fp8=fp8)
        self.o_proj = Linear(heads * self.v_head_dim, spec.hidden_size, bias=bias, fp8=fp8)
        scale = self.head_dim**-0.5 * yarn_softmax_mscale(spec.rope_scaling)
        # Every backend takes a v narrower than q.k (xorl_kernels.flash_attn, SDPA; the ring and
        # Ulysses that the context-parallel plan puts here instead).
        backend = attention_backend(spec.attn_implementation).local
        self.core_attention: nn.Module = LocalAttention(softmax_scale=scale, backend=backend)
        # Where the one RoPE key every head shares meets the per-head tensors: nothing to do in one
        # process; the TP layout's entry into the head-parallel region (module docstring).
        self.rope_key_to_heads: nn.Module = nn.Identity()

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        # Shapes come from the up-projections: under TP they hold this rank's heads (-1), under
        # sequence parallelism the whole sequence while ``hidden`` is this rank's shard.
        batch, seq = q.shape[:2]
        q_nope, q_rot = q.view(batch, seq, -1, self.head_dim).split(
            (self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        k_rot = self.rope_key_to_heads(k_rot).reshape(batch, seq, 1, self.qk_rope_head_dim)
        if self.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        out = self.core_attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self.o_proj(out.reshape(batch, seq, -1))
