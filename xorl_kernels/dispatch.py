"""The one place that names the op backends and reads the force-reference switch.

Every op in xorl_kernels picks its backend through :func:`pick_backend`, in one order:

    csrc       the CUDA extension xorl_kernels._C (CUDA tensors, extension built and able to run)
    triton     the op's Triton kernels (CUDA tensors)
    torch_cpu  torch's own fused CPU kernel for the op, where torch has one (CPU tensors; flash
               attention: aten's CPU flash attention, which never holds a score matrix)
    reference  the op's plain-torch reference (CPU tensors of an op without a torch_cpu kernel;
               any tensors when forced); it stays the tests' float64-capable oracle

An op lists the backends it has (flash attention has no csrc kernel; the Ulysses transposes have
no Triton one) and callers may request one by name (``backend="triton"``); ``None`` means "pick".
An op may send a call its torch_cpu kernel cannot compute on to its reference (flash attention
does so for fp64, the oracle's dtype).

``XORL_FORCE_REFERENCE`` sends every automatic pick to the reference (debugging). Environment
flags are parsed one way everywhere (:func:`env_flag`): 1/true/yes/on are on, 0/false/no/off and
empty are off, anything else is an error that names the variable, so a typo never silently
means the opposite.
"""

from __future__ import annotations

import os

from xorl_kernels import cuda_ext

CSRC, TRITON, TORCH_CPU, REFERENCE = "csrc", "triton", "torch_cpu", "reference"
BACKENDS = (CSRC, TRITON, TORCH_CPU, REFERENCE)
FORCE_REFERENCE_ENV = "XORL_FORCE_REFERENCE"

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """A boolean environment variable: unset or 0/false/no/off/empty is off, 1/true/yes/on is on."""
    value = os.environ.get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: use 1/true/yes/on or 0/false/no/off (or leave it unset)")


def force_reference() -> bool:
    """XORL_FORCE_REFERENCE=1 sends every automatic backend pick to the plain-torch reference."""
    return env_flag(FORCE_REFERENCE_ENV)


def triton_interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET on), the only way its kernels run on CPU
    tensors; the CPU tests set it before triton is imported. Triton's own variable, so read the
    way Triton reads it (no error for other values)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _ON


def pick_backend(
    op: str, tensors, available: tuple[str, ...], requested: str | None = None
) -> str:
    """The backend ``op`` runs on for ``tensors`` (None entries are ignored).

    ``available``: the op's backends in dispatch order (a subset of BACKENDS, ending with
    "reference"). ``requested``: a backend name to use as is (checked against ``available``), or
    None to pick: the reference when forced; when any tensor is off CUDA, torch_cpu if the op has
    it, else the reference; else the first of csrc (when the extension can run on these tensors)
    and triton that the op has.
    """
    if requested is not None:
        if requested not in available:
            raise ValueError(f"{op}: backend must be one of {available} (or None to pick), got {requested!r}")
        return requested
    tensors = [t for t in tensors if t is not None]
    if force_reference() or not tensors:
        return REFERENCE
    if any(not t.is_cuda for t in tensors):
        return TORCH_CPU if TORCH_CPU in available else REFERENCE
    if CSRC in available and cuda_ext.ext_runs_on(*tensors):
        return CSRC
    return TRITON if TRITON in available else REFERENCE
