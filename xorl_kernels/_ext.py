"""The compiled CUDA extension ``xorl_kernels._C`` and thin, checked wrappers around its kernels.

The kernels (csrc/) take raw device pointers, sizes and a CUDA stream, so the extension does not
depend on the torch ABI. Everything torch-shaped happens here: device, dtype, shape and contiguity
checks (each error names the argument and the fix), output allocation, the current stream and a
device guard. The wrappers never read a device value on the host.

``has_cuda_ext()`` says whether the extension was built and imports; ``use_cuda_ext(*tensors)``
is the dispatch test the op files use (extension built, every tensor on CUDA, and
XORL_FORCE_REFERENCE not set). The op files (zigzag_gather.py, routing_metadata.py,
ulysses_transpose.py, permute.py) hold the plain-torch references and the documented layouts.

This module holds the loading/probing of the extension, the shared input checks and ``_launch``.
The per-op wrappers live in _ext_zigzag.py, _ext_moe.py and _ext_ulysses.py and are re-exported
(lazily) at the end of this module, so ``xorl_kernels._ext.ext_*`` keeps working.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xorl._lazy import lazy_getattr

try:
    from xorl_kernels import _C
except ImportError as _err:  # not built: pure-Python install, or built for another Python
    _C = None
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None


def _warn_if_stale() -> None:
    """In a source checkout, say so when csrc/ changed after the extension was built: an editable
    install does not rebuild it by itself."""
    built = Path(_C.__file__)
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    if not csrc.is_dir():
        return
    sources = [p for p in csrc.iterdir() if p.suffix in (".cu", ".cuh", ".cpp", ".h")]
    newer = sorted(p.name for p in sources if p.stat().st_mtime > built.stat().st_mtime)
    if newer:
        warnings.warn(
            f"xorl_kernels._C is older than csrc/{', csrc/'.join(newer)}; rebuild it with "
            "`pip install -e . --no-deps` or `python setup.py build_ext --inplace`",
            stacklevel=2,
        )


if _C is not None:
    try:
        _warn_if_stale()
    except OSError:
        pass

_COMBINE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ID_DTYPES = (torch.int32, torch.int64)


def has_cuda_ext() -> bool:
    """True when ``xorl_kernels._C`` imports (it was built at install time with nvcc)."""
    return _C is not None


def cuda_ext_import_error() -> ImportError | None:
    """Why ``xorl_kernels._C`` did not import (None when it did)."""
    return _IMPORT_ERROR


def force_reference() -> bool:
    """XORL_FORCE_REFERENCE=1 sends every op to its plain-torch reference (debugging)."""
    return os.environ.get("XORL_FORCE_REFERENCE", "0") not in ("", "0")


def use_cuda_ext(*tensors: torch.Tensor | None) -> bool:
    """Dispatch test: the extension is built and can run on the tensors' GPU, every given tensor is
    on CUDA, and no reference is forced."""
    if _C is None or force_reference():
        return False
    devices = {t.device for t in tensors if t is not None}
    if not devices or any(d.type != "cuda" for d in devices):
        return False
    return all(cuda_ext_runs_on(d) for d in devices)


# The kernels are compiled for sm_80 (SASS + PTX, so later GPUs JIT it) and sm_90a.
_MIN_CAPABILITY = (8, 0)
_RUNS_ON: dict[int, bool] = {}


def cuda_ext_runs_on(device: torch.device) -> bool:
    """Whether the extension can launch on ``device``: its runtime talks to the driver (a runtime
    newer than the driver cannot) and the GPU is sm_80 or newer. Checked once per device; when it
    cannot, a warning says why and the ops fall back to their Triton / torch paths."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _RUNS_ON:
        status, message = _C.cuda_probe()
        capability = torch.cuda.get_device_capability(index)
        reason = None
        if status != 0:
            reason = f"its CUDA runtime {_C.cuda_runtime_version()} cannot use this driver ({message})"
        elif capability < _MIN_CAPABILITY:
            reason = f"the GPU is sm_{capability[0]}{capability[1]}, the kernels need sm_80 or newer"
        if reason is not None:
            warnings.warn(
                f"xorl_kernels._C is built but not used on cuda:{index}: {reason}; ops fall back to Triton / torch",
                stacklevel=2,
            )
        _RUNS_ON[index] = reason is None
    return _RUNS_ON[index]


# ---------------------------------------------------------------------------------------------
# Checks and launch
# ---------------------------------------------------------------------------------------------


def _require_ext(op: str):
    if _C is None:
        raise RuntimeError(
            f"{op}: the CUDA extension xorl_kernels._C is not available ({_IMPORT_ERROR}); reinstall xorl "
            "with nvcc on the PATH (pip install -e .) or call the op's plain-torch reference"
        )
    return _C


def _check(
    t: torch.Tensor,
    name: str,
    op: str,
    *,
    device: torch.device | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    dim: int | None = None,
    host: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if host and t.is_cuda:
        raise ValueError(f"{op}: host emulation runs on CPU tensors, got {name} on {t.device}")
    if not host and not t.is_cuda:
        raise ValueError(
            f"{op}: {name} must be a CUDA tensor, got one on {t.device}; CPU tensors use the reference"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but the other inputs are on {device}; move it with .to()"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous; pass {name}.contiguous()")


def _check_out(
    out: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    op: str,
    host: bool = False,
) -> None:
    _check(out, "out", op, device=device, dtypes=[dtype], host=host)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")


def _launch(device: torch.device, kernel: str, host: bool, *args) -> None:
    """Run ``_C.<kernel>(*args, stream)`` on ``device`` and its current torch stream.

    ``host=True`` runs ``_C.<kernel>_host(*args)`` instead: the same index map on CPU memory, which
    is how the address arithmetic (here and in csrc) is tested on machines without a GPU.
    """
    if host:
        getattr(_C, f"{kernel}_host")(*args)
        return
    with torch.cuda.device(device):
        getattr(_C, kernel)(*args, torch.cuda.current_stream(device).cuda_stream)


# ---------------------------------------------------------------------------------------------
# Re-exports of the per-op wrappers
# ---------------------------------------------------------------------------------------------

# Why lazy (PEP 562) and not ``from xorl_kernels._ext_moe import ...`` here: the wrapper modules
# import the checks above from this module, so an eager re-export is a cycle that breaks whenever a
# wrapper module is imported before this one (this module would run its re-export while that
# module is only partly loaded). Looked up on first use, ``xorl_kernels._ext.ext_*`` works in
# either order, for attribute access and ``from xorl_kernels._ext import ...`` alike.
_MOVED = {
    "_zigzag_view": "xorl_kernels._ext_zigzag",
    "ext_zigzag_copy": "xorl_kernels._ext_zigzag",
    "ext_routing_metadata": "xorl_kernels._ext_moe",
    "ext_permute_rows": "xorl_kernels._ext_moe",
    "ext_unpermute_combine": "xorl_kernels._ext_moe",
    "ulysses_piece_numels": "xorl_kernels._ext_ulysses",
    "_pack_inputs": "xorl_kernels._ext_ulysses",
    "_pack_buffer": "xorl_kernels._ext_ulysses",
    "_unpack_inputs": "xorl_kernels._ext_ulysses",
    "_unpack_output": "xorl_kernels._ext_ulysses",
    "ext_ulysses_pack": "xorl_kernels._ext_ulysses",
    "ext_ulysses_unpack": "xorl_kernels._ext_ulysses",
    "ext_ulysses_pack_reverse": "xorl_kernels._ext_ulysses",
    "ext_ulysses_unpack_reverse": "xorl_kernels._ext_ulysses",
}
__getattr__ = lazy_getattr(__name__, _MOVED)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from xorl_kernels._ext_moe import ext_permute_rows, ext_routing_metadata, ext_unpermute_combine  # noqa: F401
    from xorl_kernels._ext_ulysses import (  # noqa: F401
        _pack_buffer,
        _pack_inputs,
        _unpack_inputs,
        _unpack_output,
        ext_ulysses_pack,
        ext_ulysses_pack_reverse,
        ext_ulysses_unpack,
        ext_ulysses_unpack_reverse,
        ulysses_piece_numels,
    )
    from xorl_kernels._ext_zigzag import _zigzag_view, ext_zigzag_copy  # noqa: F401
