"""ParallelState (the DeviceMesh and the EP mesh), sharding helpers and collectives."""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "ParallelConfig": ".parallel_config",
    "ParallelState": ".parallel_state",
    "init_parallel_state": ".parallel_state",
    "zigzag_shard": ".zigzag",
    "zigzag_unshard": ".zigzag",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
