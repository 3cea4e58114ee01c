"""SwiGLU activation: op.py (swiglu, dispatch, custom op), triton_kernels.py, reference.py."""
