"""RMSNorm (+ residual add): op.py (rms_norm, add_rms_norm, dispatch, custom ops), triton_kernels.py,
reference.py (plain torch)."""
