"""Grouped GEMM for MoE experts: op.py (grouped_gemm, autograd, dispatch), triton_kernels.py,
checks.py (group_sizes on the host), reference.py (plain torch)."""
