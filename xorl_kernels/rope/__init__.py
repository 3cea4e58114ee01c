"""Rotary position embedding: op.py (apply_rotary, dispatch, custom op), triton_kernels.py, reference.py."""
