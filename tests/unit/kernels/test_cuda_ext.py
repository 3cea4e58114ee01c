"""The CUDA extension builds and imports wherever nvcc exists, and its bindings behave without a GPU.

Why this runs on CPU CI: the extension links cudart statically and takes raw pointers, so it
compiles and imports on a machine with nvcc but no GPU. A broken kernel or binding fails the
install or this import, not a GPU job later. Kernel numerics are in the op tests (marked gpu).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.support.csrc_helpers import require_cuda_ext
from xorl_kernels import cuda_ext
from xorl_kernels.moe_permute.csrc import ext_permute_rows, ext_routing_metadata
from xorl_kernels.ulysses.layout import ulysses_piece_numels

needs_ext = pytest.mark.skipif(not cuda_ext.has_cuda_ext(), reason="xorl_kernels._C not built (no nvcc)")


def test_extension_imports_where_nvcc_exists():
    if shutil.which("nvcc") is None or os.environ.get("XORL_SKIP_CUDA_EXT", "0") not in ("", "0"):
        pytest.skip("nvcc not on PATH: the pure-Python install is expected")
    from xorl_kernels import _C  # noqa: F401  (a failure here is the build being broken)

    assert cuda_ext.has_cuda_ext(), f"xorl_kernels._C did not import: {cuda_ext.cuda_ext_import_error()}"


@needs_ext
def test_bindings_report_errors_and_runtime_version():
    from xorl_kernels import _C

    assert _C.cuda_runtime_version() >= 11000
    # Invalid arguments come back from the launcher as a CUDA error naming the kernel (no device needed).
    with pytest.raises(RuntimeError, match=r"xorl_kernels\._C\.zigzag_copy failed: CUDA error 1"):
        _C.zigzag_copy(0, 0, 1, 10, 4, 0, 0, 0, 1, 0, False, 0)  # world = 0
    with pytest.raises(RuntimeError, match=r"_C\.routing_metadata failed"):
        _C.routing_metadata(0, False, 8, 2, _C.routing_max_experts() + 1, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="at most 4 segments"):
        _C.block_transpose([(0, 0, 1, 1, 16, 0, 0, 0, 0)] * 5, 0)
    # Empty work launches nothing and succeeds.
    _C.permute_rows(0, 0, 0, 0, 0, 16, 0)
    _C.block_transpose([], 0)
    # Routing scratch: per-tile counts of the 65 buckets, never more than ~one value per slot.
    assert 2 * 65 <= _C.routing_workspace_elems(100_000, 64) <= 2 * 100_000


@needs_ext
def test_wrappers_check_their_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        ext_permute_rows(x, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        ext_routing_metadata(torch.zeros(4, 2, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="number of heads 3, not divisible by world=2"):
        ulysses_piece_numels([(1, 4, 3, 8)], 2, 2, "ulysses_pack")


@pytest.mark.gpu
def test_extension_runs_on_this_gpu():
    require_cuda_ext()
    status, message = cuda_ext._C.cuda_probe()
    assert status == 0, message
    # A launch on a side stream lands on that stream (the wrappers pass torch's current stream).
    x = torch.randn(64, 48, device="cuda")
    src = torch.randperm(64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = ext_permute_rows(x, src)
    side.synchronize()
    assert torch.equal(out, x[src])
