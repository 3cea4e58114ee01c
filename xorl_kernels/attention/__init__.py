"""Flash attention (the folder is not named flash_attn, so that ``xorl_kernels.flash_attn`` is only
the function): op.py (flash_attn, flash_attn_with_lse, the ring-step pieces, autograd and
dispatch), layout.py (input normalisation), the Triton kernels (fwd_triton.py, bwd_triton.py with
bwd_dq_triton.py, preprocess_triton.py; loop bounds in bounds.py, GQA slices in dkdv_splits.py,
shared pieces and the tile counter in common.py), cpu_flash.py (CPU tensors: torch's CPU flash
kernel), reference.py (plain torch, the oracle), merge.py (merge_attn_states), sinks.py
(apply_sinks, sink_grad)."""
