"""The compiled CUDA extension ``xorl_kernels._C``: loading, probing, and the shared checks and launch.

The kernels (csrc/) take raw device pointers, sizes and a CUDA stream, so the extension does not
depend on the torch ABI. Everything torch-shaped happens in Python: device, dtype, shape and
contiguity checks (each error names the argument and the fix), output allocation, the current
stream and a device guard. The wrappers never read a device value on the host.

``has_cuda_ext()`` says whether the extension was built and imports; ``ext_runs_on(*tensors)``
whether it can run on these tensors (xorl_kernels.dispatch uses it to pick the csrc backend).
The per-op wrappers live next to their op: zigzag/csrc.py, moe_permute/csrc.py, ulysses/csrc.py;
they import ``check``, ``check_out``, ``launch`` and ``require_ext`` from here (and nothing here
imports them back).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

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

COMBINE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ID_DTYPES = (torch.int32, torch.int64)


def has_cuda_ext() -> bool:
    """True when ``xorl_kernels._C`` imports (it was built at install time with nvcc)."""
    return _C is not None


def cuda_ext_import_error() -> ImportError | None:
    """Why ``xorl_kernels._C`` did not import (None when it did)."""
    return _IMPORT_ERROR


def ext_runs_on(*tensors: torch.Tensor | None) -> bool:
    """The extension is built and can run on the tensors' GPU, and every given tensor is on CUDA."""
    if _C is None:
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


def require_ext(op: str):
    if _C is None:
        raise RuntimeError(
            f"{op}: the CUDA extension xorl_kernels._C is not available ({_IMPORT_ERROR}); reinstall xorl "
            "with nvcc on the PATH (pip install -e .) or call the op's plain-torch reference"
        )
    return _C


def check(
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


def check_out(
    out: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    op: str,
    host: bool = False,
) -> None:
    check(out, "out", op, device=device, dtypes=[dtype], host=host)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")


def launch(device: torch.device, kernel: str, host: bool, *args) -> None:
    """Run ``_C.<kernel>(*args, stream)`` on ``device`` and its current torch stream.

    ``host=True`` runs ``_C.<kernel>_host(*args)`` instead: the same index map on CPU memory, which
    is how the address arithmetic (here and in csrc) is tested on machines without a GPU.
    """
    if host:
        getattr(_C, f"{kernel}_host")(*args)
        return
    with torch.cuda.device(device):
        getattr(_C, kernel)(*args, torch.cuda.current_stream(device).cuda_stream)
