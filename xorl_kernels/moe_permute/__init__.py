"""MoE token permute / unpermute: op.py (permute_tokens, unpermute_tokens, autograd, dispatch),
routing.py (the routing metadata), triton_kernels.py, csrc.py (the extension's wrappers),
reference.py (plain torch)."""
