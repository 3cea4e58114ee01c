"""``experts_implementation="xorl"``: transformers' fused MoE experts on xorl's kernels.

transformers 5 stores an MoE layer's experts as 3-D weights in one module decorated with
``@use_experts_implementation`` (Qwen2/3-MoE, Mixtral, OLMoE, GLM-4.5, DeepSeek-V2/V3, gpt-oss) and
calls ``fn(self, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` from its
``ExpertsInterface``. This function runs that call as xorl's MoE does: ``permute_tokens`` (the
(token, k) rows grouped by expert), one grouped GEMM for gate and up together (with the per-expert
bias where the class declares ``has_bias``), the SwiGLU (xorl's fused one; gpt-oss's clamped one on
its interleaved gate / up columns), one grouped GEMM for down, and ``unpermute_tokens`` (the
weighted sum of each token's rows, fp32, in a fixed order: deterministic).

The class's flags say the layout: ``is_transposed`` ([E, in, out], gpt-oss) or not ([E, out, in],
transposed here as a view), ``is_concatenated`` ([gate; up]) or interleaved ([g0, u0, g1, ...]),
``has_gate`` (gate_up_proj, else up_proj alone), ``has_bias``, ``has_post_expert_norm``. A gating
function other than SiLU-GLU or gpt-oss's is computed by the class's own ``_apply_gate`` (correct,
not fused).

Expert parallelism: under ``ep_implementation="xorl"`` (xorl/hf/expert_parallel.py) the tokens travel
by xorl's deduplicated dispatch and ``grouped_experts`` below runs the local experts on the rows that
arrive; under transformers' other EP implementations (``_is_expert_parallel``) ids >= the local expert
count are another rank's experts, and their slots get weight 0 (computed on expert 0 and dropped, so no
host read of how many there are).
"""

from __future__ import annotations

import torch
from torch import nn

from xorl_kernels.activation.op import clamped_swiglu, swiglu
from xorl_kernels.expert_gemm.op import grouped_gemm
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens


def _in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[E, in, out], the grouped GEMM's layout: transformers' default [E, out, in] as a view."""
    return weight if transposed else weight.transpose(1, 2)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or getattr(act, "__name__", "") == "silu" or act is nn.functional.silu


def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """The gated activation of the [N, 2I] gate_up rows, fused where xorl has the kernel."""
    concatenated = getattr(self, "is_concatenated", True)
    gate, up = gate_up.chunk(2, dim=-1) if concatenated else (gate_up[..., ::2], gate_up[..., 1::2])
    own_gate = type(self)._apply_gate.__name__ != "_default_apply_gate"
    if own_gate and hasattr(self, "alpha") and hasattr(self, "limit"):  # gpt-oss's clamped SwiGLU
        return clamped_swiglu(gate, up, float(self.alpha), float(self.limit))
    if not own_gate and _is_silu(getattr(self, "act_fn", None)):
        return swiglu(gate, up)
    return self._apply_gate(gate_up)


def grouped_experts(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The experts module ``self`` on rows already grouped by (local) expert: gate / up GEMM, the gate,
    down GEMM (and the post-expert norm where the class has one), one output row per input row. Also
    the local compute of xorl's expert-parallel dispatch (xorl/hf/expert_parallel.py)."""
    transposed = getattr(self, "is_transposed", False)
    has_gate = getattr(self, "has_gate", True)
    has_bias = getattr(self, "has_bias", False)
    first = self.gate_up_proj if has_gate else self.up_proj
    bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    h = grouped_gemm(x_sorted, _in_out(first, transposed), tokens_per_expert, bias)
    h = _gate(self, h) if has_gate else self.act_fn(h)
    y = grouped_gemm(h, _in_out(self.down_proj, transposed), tokens_per_expert,
                     self.down_proj_bias if has_bias else None)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return y


def xorl_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    first = self.gate_up_proj if getattr(self, "has_gate", True) else self.up_proj
    num_experts = first.shape[0]
    ids, weights = top_k_index, top_k_weights
    if getattr(self, "_is_expert_parallel", False):
        foreign = ids >= num_experts
        ids = torch.where(foreign, torch.zeros_like(ids), ids)
        weights = torch.where(foreign, torch.zeros_like(weights), weights)
    x_sorted, row_map, tokens_per_expert = permute_tokens(hidden_states, ids, num_experts)
    y = grouped_experts(self, x_sorted, tokens_per_expert)
    return unpermute_tokens(y, row_map, weights.to(torch.float32)).to(hidden_states.dtype)
