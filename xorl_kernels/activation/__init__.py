"""Gated activations of MLPs: op.py (swiglu, dispatch, custom ops), triton_kernels.py, reference.py."""
