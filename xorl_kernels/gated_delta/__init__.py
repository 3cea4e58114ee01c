"""The gated delta rule (the folder is not named gated_delta_rule, so that ``xorl_kernels.gated_delta_rule``
is only the function): op.py (gated_delta_rule, the custom ops, dispatch and argument checks),
reference.py (plain torch: the chunked algorithm, forward and hand-derived backward), the Triton
kernels (fwd_triton.py, bwd_triton.py; shared pieces in triton_common.py)."""
