"""xorl_kernels: the op layer (imports nothing from xorl/, holds no process groups).

One folder per op, each with the public function and its autograd, its kernels (Triton and/or
csrc wrappers) and its plain-torch reference side by side:

    attention/     flash_attn, flash_attn_with_lse (op.py), merge_attn_states (merge.py)
    grouped_gemm/  grouped_gemm
    fp8/           fp8_linear (torch._scaled_mm), fp8_grouped_gemm (blockwise, Triton): train.fp8
    moe_permute/   permute_tokens, unpermute_tokens, the routing metadata
    ulysses/       the Ulysses all-to-all pack / unpack
    zigzag/        the zig-zag context-parallel gather / scatter (and zigzag_positions)
    dispatch.py    backend names and the XORL_FORCE_REFERENCE switch: every op picks its backend there
    cuda_ext.py    the CUDA extension xorl_kernels._C (has_cuda_ext)

The public names are bound here eagerly, after their folders are imported. The attention folder
is ``attention/`` so that ``xorl_kernels.flash_attn`` names only the function. ``grouped_gemm/``
still shares its op's name (``xorl_kernels.grouped_gemm`` is the function): import a module of it
with ``from xorl_kernels.grouped_gemm import op`` (``import xorl_kernels.grouped_gemm.op as op``
would look the folder up as an attribute and find the function). Importing this package is
cheap: Triton loads on the first kernel launch.
"""

from xorl_kernels.attention.merge import merge_attn_states
from xorl_kernels.attention.op import flash_attn, flash_attn_with_lse
from xorl_kernels.cuda_ext import has_cuda_ext
from xorl_kernels.grouped_gemm.op import grouped_gemm
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens

__all__ = [
    "flash_attn",
    "flash_attn_with_lse",
    "grouped_gemm",
    "has_cuda_ext",
    "merge_attn_states",
    "permute_tokens",
    "unpermute_tokens",
]
