"""Fused linear + cross-entropy: op.py (fused_linear_cross_entropy, the chunk loop and its autograd),
triton_kernels.py (per-chunk row statistics and logit gradient), reference.py (plain torch)."""
