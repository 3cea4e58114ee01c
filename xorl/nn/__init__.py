"""Drop-in nn.Module replacements that wrap the xorl_kernels ops with the parallel layer."""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "RingAttention": ".ring_attention",
    "UlyssesAttention": ".ulysses_attention",
    "ContextParallelAttention": ".ulysses_attention",
    "MoE": ".moe",
    "ColumnParallelLinear": ".tp_linear",
    "RowParallelLinear": ".tp_linear",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
