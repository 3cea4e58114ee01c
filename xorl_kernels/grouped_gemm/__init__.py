"""Grouped GEMM for MoE experts: op.py (grouped_gemm, autograd, dispatch), triton_kernels.py,
reference.py (plain torch)."""
