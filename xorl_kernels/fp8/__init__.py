"""FP8 training GEMMs: ``fp8_linear`` (dense, through torch._scaled_mm) and ``fp8_grouped_gemm``
(MoE experts, blockwise, a Triton kernel); quantisation in ``quantize.py`` (fused Triton casts on CUDA,
``triton_quantize.py``), float64 references of the formulas in ``reference.py``."""

from xorl_kernels.fp8.grouped import fp8_grouped_gemm
from xorl_kernels.fp8.linear import RECIPES, fp8_linear

__all__ = ["RECIPES", "fp8_grouped_gemm", "fp8_linear"]
