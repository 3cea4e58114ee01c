"""xorl_kernels: the op layer.

One file per op: the kernel (Triton or csrc), a plain-torch reference and a
torch.autograd.Function. No process groups here. Dispatch order for every op: csrc CUDA kernel
(GPU tensors, extension built) -> Triton (GPU tensors) -> plain-torch reference (CPU, or forced
with XORL_FORCE_REFERENCE=1).
"""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "flash_attn": ".flash_attention",
    "flash_attn_with_lse": ".flash_attention",
    "merge_attn_states": ".attn_state_merge",
    "grouped_gemm": ".grouped_gemm_op",
    "permute_tokens": ".permute",
    "unpermute_tokens": ".permute",
    "has_cuda_ext": "._ext",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
