"""xorl_kernels: the op layer (imports nothing from xorl/, holds no process groups).

One folder per op, each with the public function and its autograd, its kernels (Triton and/or
csrc wrappers) and its plain-torch reference side by side:

    activation/    swiglu (silu(gate) * up; strided halves of a merged gate_up read in place)
    attention/     flash_attn, flash_attn_with_lse (op.py), merge_attn_states (merge.py)
    expert_gemm/   grouped_gemm (the MoE experts' GEMM over row groups; ops xorl::grouped_gemm*)
    fused_linear_ce/  fused_linear_cross_entropy (the summed loss of hidden @ lm_head^T, chunked)
    fp8/           fp8_linear (torch._scaled_mm), fp8_grouped_gemm (blockwise, Triton): train.fp8
    gated_delta/   gated_delta_rule (Gated DeltaNet's linear attention: chunked, varlen, GQA, states in / out)
    moe_permute/   permute_tokens, unpermute_tokens, the routing metadata
    rmsnorm/       rms_norm (optionally with the residual add before it), gated_rms_norm (norm(x) * silu(gate))
    rope/          apply_rotary (precomputed cos / sin: every RoPE variant, partial rotary)
    short_conv/    causal_conv1d (depthwise causal conv + activation, varlen, initial state: Gated DeltaNet's)
    ulysses/       the Ulysses all-to-all pack / unpack
    zigzag/        the zig-zag context-parallel gather / scatter (and zigzag_positions)
    doc_chunks.py  packed documents cut into chunks no chunk crosses (the linear-attention kernels' grid)
    dispatch.py    backend names and the XORL_FORCE_REFERENCE switch: every op picks its backend there
    cuda_ext.py    the CUDA extension xorl_kernels._C (has_cuda_ext)

The public names are bound here eagerly, after their folders are imported. No folder shares its
function's name (``attention/`` holds ``flash_attn``, ``expert_gemm/`` holds ``grouped_gemm``), so
``xorl_kernels.<name>`` is either a function or a package, never a function hiding a package
(tests/architecture/test_house_rules.py holds this). Importing this package is cheap: Triton loads on the
first kernel launch.
"""

from xorl_kernels.activation.op import swiglu
from xorl_kernels.attention.merge import merge_attn_states
from xorl_kernels.attention.op import flash_attn, flash_attn_with_lse
from xorl_kernels.cuda_ext import has_cuda_ext
from xorl_kernels.expert_gemm.op import grouped_gemm
from xorl_kernels.fused_linear_ce.op import fused_linear_cross_entropy
from xorl_kernels.gated_delta.op import gated_delta_rule
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens
from xorl_kernels.rmsnorm.gated import gated_rms_norm
from xorl_kernels.rmsnorm.op import rms_norm
from xorl_kernels.rope.op import apply_rotary
from xorl_kernels.short_conv.op import causal_conv1d

__all__ = [
    "apply_rotary",
    "causal_conv1d",
    "flash_attn",
    "flash_attn_with_lse",
    "fused_linear_cross_entropy",
    "gated_delta_rule",
    "gated_rms_norm",
    "grouped_gemm",
    "has_cuda_ext",
    "merge_attn_states",
    "permute_tokens",
    "rms_norm",
    "swiglu",
    "unpermute_tokens",
]
