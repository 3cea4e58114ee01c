"""Flash attention (the folder is not named flash_attn, so that ``xorl_kernels.flash_attn`` is only
the function): op.py (flash_attn, flash_attn_with_lse, the ring-step pieces, autograd and
dispatch), layout.py (input normalisation), fwd_triton.py / bwd_triton.py / common.py (the Triton
kernels), reference.py (plain torch), merge.py (merge_attn_states)."""
