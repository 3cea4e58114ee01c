"""Where a test runs the Triton kernels: the same checks on a GPU machine and on CPU CI.

On a machine with CUDA the kernels run compiled, on CUDA tensors (conftest.py leaves
TRITON_INTERPRET unset there). Without CUDA they run under the interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1 before triton is imported). Tests build their inputs on the
CPU from a seeded generator, move them with ``to_triton`` and compare against float64 references
computed on the CPU, so both machines check the same numbers against the same references.
"""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> torch.device:
    """CUDA where a GPU exists, else the CPU under the interpreter; skips when neither can run Triton
    (no GPU and TRITON_INTERPRET=0 set by hand)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    return torch.device("cpu")


def to_triton(*tensors: torch.Tensor | None):
    """The tensors on triton_device() (None stays None); one tensor in, one out."""
    device = triton_device()
    moved = tuple(None if t is None else t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved
