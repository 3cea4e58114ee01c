"""The short depthwise causal convolution (the folder is not named causal_conv1d, so that
``xorl_kernels.causal_conv1d`` is only the function): op.py (causal_conv1d, custom ops, dispatch,
argument checks), triton_kernels.py, reference.py (plain torch, forward and backward)."""
