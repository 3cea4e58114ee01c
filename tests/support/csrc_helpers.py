"""What a gpu test of a csrc kernel needs: the extension built and able to run on this GPU."""

from __future__ import annotations

import shutil

import pytest
import torch

from xorl_kernels import cuda_ext


def require_cuda_ext() -> None:
    """Skip where the extension could not be built (no nvcc); fail where it should have been."""
    if not cuda_ext.has_cuda_ext():
        if shutil.which("nvcc") is None:
            pytest.skip("no nvcc on this machine: the csrc kernels were not built")
        pytest.fail(f"nvcc exists but xorl_kernels._C did not import: {cuda_ext.cuda_ext_import_error()}")
    device = torch.device("cuda", torch.cuda.current_device())
    assert cuda_ext.cuda_ext_runs_on(device), "xorl_kernels._C cannot launch on this GPU (see the warning)"
