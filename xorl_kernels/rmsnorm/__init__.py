"""RMSNorm (+ residual add): op.py (rms_norm, add_rms_norm, dispatch, custom ops), triton_kernels.py,
reference.py (plain torch); the gated RMSNorm of linear-attention layers (gated_rms_norm:
RMSNorm(x) * weight * silu(gate)) in gated.py with gated_triton.py, its reference in reference.py."""
