"""grouped_gemm: Triton kernels (interpreter on CPU) and the reference vs a float64 per-group loop.

The float64 loop below is written out here (no autograd, explicit dx/dw formulas), so it shares
nothing with the code under test. Shapes cross the interpreter's 16/32-wide tiles on purpose:
M, K and N are not multiples of the tiles, and groups are empty, single-row, or take every row.
"""

from __future__ import annotations

import pytest
import torch

from xorl_kernels.grouped_gemm import _resolve_backend, grouped_gemm
from xorl_kernels.grouped_gemm_triton import (
    forward_config,
    grouped_gemm_forward,
    grouped_gemm_weight_grad,
    weight_grad_config,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

# (group sizes, K, N): ragged with empty and single-row groups; one group takes all rows; M = 0;
# even K (the unmasked-K path of the forward kernel).
CASES = [
    ([0, 1, 37, 0, 20, 5], 40, 50),
    ([0, 0, 45, 0], 24, 33),
    ([0, 0, 0], 24, 20),
    ([16, 3, 29], 32, 64),
]


def _float64_loop(x, w, sizes, dy):
    """y, dx, dw in float64, one plain matmul per group."""
    x, w, dy = x.double(), w.double(), dy.double()
    y = torch.empty(x.shape[0], w.shape[2], dtype=torch.float64)
    dx = torch.empty_like(x)
    dw = torch.empty_like(w)
    start = 0
    for g, rows in enumerate(sizes):
        sl = slice(start, start + rows)
        y[sl] = x[sl] @ w[g]
        dx[sl] = dy[sl] @ w[g].T
        dw[g] = x[sl].T @ dy[sl]
        start += rows
    return y, dx, dw


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(sizes, k, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(len(sizes), k, n, generator=gen) / k**0.5).to(dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_gradients_match_float64_loop(case, dtype, backend):
    sizes, k, n = CASES[case]
    x, w, dy = _inputs(sizes, k, n, dtype, seed=case)
    index_dtype = torch.int32 if case % 2 else torch.int64
    group_sizes = torch.tensor(sizes, dtype=index_dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)

    y = grouped_gemm(x, w, group_sizes, backend=backend)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref, dx_ref, dw_ref = _float64_loop(x.detach(), w.detach(), sizes, dy)

    assert y.shape == (sum(sizes), n) and y.dtype == dtype
    assert dx.dtype == dtype and dw.dtype == dtype
    tol = TOLERANCE[dtype]
    assert _rel_err(y, y_ref) < tol
    assert _rel_err(dx, dx_ref) < tol
    assert _rel_err(dw, dw_ref) < tol
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert torch.equal(dw[g], torch.zeros_like(dw[g])), f"group {g} has no rows: dw must be exactly 0"


def test_kernels_write_every_element_of_poisoned_outputs():
    """NaN-filled outputs: any row, column or zero-row group the kernels skip stays NaN and fails."""
    sizes = [3, 0, 40, 1, 0, 17]
    x, w, dy = _inputs(sizes, 40, 50, torch.float32, seed=11)
    group_sizes = torch.tensor(sizes, dtype=torch.int32)
    y_ref, dx_ref, dw_ref = _float64_loop(x, w, sizes, dy)

    y = grouped_gemm_forward(x, w, group_sizes, out=torch.full_like(y_ref, float("nan"), dtype=x.dtype))
    dx = grouped_gemm_forward(dy, w.transpose(1, 2), group_sizes, out=torch.full_like(x, float("nan")))
    dw = grouped_gemm_weight_grad(x, dy, group_sizes, torch.float32, out=torch.full_like(w, float("nan")))

    for name, out, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert not out.isnan().any(), f"{name}: kernel left poisoned elements"
        assert _rel_err(out, ref) < 1e-5, name
    assert torch.equal(dw[1], torch.zeros_like(dw[1])) and torch.equal(dw[4], torch.zeros_like(dw[4]))


def test_strided_inputs():
    """Non-contiguous x (a column slice), w (a transposed view) and dy: the kernels take strides."""
    sizes = [9, 0, 26]
    gen = torch.Generator().manual_seed(5)
    x_wide = torch.randn(sum(sizes), 70, generator=gen)
    x = x_wide[:, 3:43]  # [35, 40], row stride 70
    w = torch.randn(3, 36, 40, generator=gen).transpose(1, 2)  # [3, 40, 36], non-contiguous
    dy = torch.randn(36, sum(sizes), generator=gen).T  # [35, 36], column-major
    group_sizes = torch.tensor(sizes)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_gemm(x, w, group_sizes, backend="triton")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref, dx_ref, dw_ref = _float64_loop(x.detach(), w.detach(), sizes, dy)
    assert _rel_err(y, y_ref) < 1e-5 and _rel_err(dx, dx_ref) < 1e-5 and _rel_err(dw, dw_ref) < 1e-5


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: (torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.tensor([1, 1])),
            ValueError,
            "x must be 2-D",
        ),
        (lambda: (torch.randn(6, 4), torch.randn(4, 5), torch.tensor([6])), ValueError, "w must be 3-D"),
        (lambda: (torch.randn(6, 4), torch.randn(2, 3, 5), torch.tensor([3, 3])), ValueError, "features"),
        (
            lambda: (torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([3.0, 3.0])),
            TypeError,
            "int32 or int64",
        ),
        (lambda: (torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([[3, 3]])), ValueError, "1-D"),
        (
            lambda: (torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([6])),
            ValueError,
            "one size per group",
        ),
        (lambda: (torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([8, -2])), ValueError, ">= 0"),
        (lambda: (torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([3, 2])), ValueError, "sum"),
        (
            lambda: (torch.randn(6, 4), torch.randn(2, 4, 5).half(), torch.tensor([3, 3])),
            TypeError,
            "same dtype",
        ),
        (
            lambda: (torch.randn(6, 4), torch.randn(0, 4, 5), torch.tensor([], dtype=torch.long)),
            ValueError,
            "0 groups",
        ),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_inputs_raise_clear_errors(make, error, match, backend):
    x, w, group_sizes = make()
    with pytest.raises(error, match=match):
        grouped_gemm(x, w, group_sizes, backend=backend)


def test_dispatch(monkeypatch):
    cpu = torch.randn(2, 2)
    assert _resolve_backend("auto", cpu) == "reference"
    assert _resolve_backend("triton", cpu) == "triton"  # the interpreter is on in the test session
    with pytest.raises(ValueError, match="backend must be one of"):
        _resolve_backend("cublas", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _resolve_backend("triton", cpu)


def test_tile_heuristic_by_shape_class(monkeypatch):
    """On a GPU: 128x128x64 / 8 warps for coarse experts, 64-row tiles when groups are short."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    coarse = forward_config(16384 * 2, 14336, 4096, 8, torch.bfloat16)
    assert (coarse.block_m, coarse.block_n, coarse.block_k, coarse.num_warps) == (128, 128, 64, 8)
    fine_few_rows = forward_config(2048 * 8, 768, 2048, 512, torch.bfloat16)
    assert fine_few_rows.block_m == 64
    assert forward_config(4096, 4096, 4096, 8, torch.float32).block_k == 32
    assert weight_grad_config(16384, 768, 2048, 128, torch.bfloat16).block_k == 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_loop_without_host_sync(dtype):
    """Real tiles on a GPU, ragged sizes, and no device->host sync anywhere in forward + backward."""
    sizes = [0, 1, 700, 0, 129, 4000, 2, 300]
    k, n = 520, 390
    x, w, dy = _inputs(sizes, k, n, dtype, seed=3)
    y_ref, dx_ref, dw_ref = _float64_loop(x, w, sizes, dy)
    x, w, dy = x.cuda().requires_grad_(True), w.cuda().requires_grad_(True), dy.cuda()
    group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_gemm(x, w, group_sizes)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel_err(y.cpu(), y_ref) < tol
    assert _rel_err(dx.cpu(), dx_ref) < tol
    assert _rel_err(dw.cpu(), dw_ref) < tol
    assert not dw[0].any() and not dw[3].any()


@pytest.mark.gpu
def test_gpu_int64_addressing():
    """M * K > 2**31 elements: rows near the end must be addressed with 64-bit offsets."""
    m, k, n = (1 << 20) + 77, 2100, 16
    sizes = [5, (1 << 20) - 5, 77]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
    group_sizes = torch.tensor(sizes, device="cuda")
    y = grouped_gemm(x, w, group_sizes)
    tail = slice(m - 300, m)
    ref = torch.cat([x[m - 300 : m - 77].double() @ w[1].double(), x[m - 77 :].double() @ w[2].double()])
    assert _rel_err(y[tail].cpu(), ref.cpu()) < 1e-2
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dw = grouped_gemm_weight_grad(x, dy, group_sizes, torch.bfloat16)
    dw2_ref = x[m - 77 :].double().T @ dy[m - 77 :].double()
    assert _rel_err(dw[2].cpu(), dw2_ref.cpu()) < 1e-2
