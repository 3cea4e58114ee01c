"""grouped_gemm: Triton kernels and the reference vs a float64 per-group loop.

The Triton kernels run compiled on CUDA tensors where a GPU exists and under the interpreter on
CPU tensors elsewhere (tests/support/triton_helpers.py); inputs are made and references computed on the CPU.

The float64 loop below is written out here (no autograd, explicit dx/dw formulas), so it shares
nothing with the code under test. Shapes cross the interpreter's 16/32-wide tiles on purpose:
M, K and N are not multiples of the tiles, and groups are empty, single-row, or take every row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.paths import REPO
from tests.support.triton_helpers import to_triton
from xorl_kernels.expert_gemm.op import _resolve_backend, grouped_gemm
from xorl_kernels.expert_gemm.triton_kernels import (
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
    return ((out.detach().double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


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
    x_cpu, w_cpu, dy_cpu = _inputs(sizes, k, n, dtype, seed=case)
    index_dtype = torch.int32 if case % 2 else torch.int64
    group_sizes = torch.tensor(sizes, dtype=index_dtype)
    if backend == "triton":
        x, w, dy, group_sizes = to_triton(x_cpu, w_cpu, dy_cpu, group_sizes)
    else:
        x, w, dy = x_cpu.clone(), w_cpu.clone(), dy_cpu
    x.requires_grad_(True)
    w.requires_grad_(True)

    y = grouped_gemm(x, w, group_sizes, backend=backend)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref, dx_ref, dw_ref = _float64_loop(x_cpu, w_cpu, sizes, dy_cpu)

    assert y.shape == (sum(sizes), n) and y.dtype == dtype
    assert dx.dtype == dtype and dw.dtype == dtype
    tol = TOLERANCE[dtype]
    assert _rel_err(y, y_ref) < tol
    assert _rel_err(dx, dx_ref) < tol
    assert _rel_err(dw, dw_ref) < tol
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert torch.equal(dw[g], torch.zeros_like(dw[g])), f"group {g} has no rows: dw must be exactly 0"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_per_group_bias_forward_and_gradients_match_float64_loop(case, dtype, backend):
    """gpt-oss experts: y[rows of g] = x_g @ w[g] + bias[g]; db[g] = the sum of dy's rows of g."""
    sizes, k, n = CASES[case]
    x_cpu, w_cpu, dy_cpu = _inputs(sizes, k, n, dtype, seed=10 + case)
    bias_cpu = torch.randn(len(sizes), n, generator=torch.Generator().manual_seed(20 + case)).to(dtype)
    group_sizes = torch.tensor(sizes, dtype=torch.int32 if case % 2 else torch.int64)
    if backend == "triton":
        x, w, bias, dy, group_sizes = to_triton(x_cpu, w_cpu, bias_cpu, dy_cpu, group_sizes)
    else:
        x, w, bias, dy = x_cpu.clone(), w_cpu.clone(), bias_cpu.clone(), dy_cpu
    for t in (x, w, bias):
        t.requires_grad_(True)

    y = grouped_gemm(x, w, group_sizes, bias, backend=backend)
    dx, dw, db = torch.autograd.grad(y, (x, w, bias), dy)
    y_ref, dx_ref, dw_ref = _float64_loop(x_cpu, w_cpu, sizes, dy_cpu)
    group_of_row = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    y_ref = y_ref + bias_cpu.double()[group_of_row]
    db_ref = torch.zeros(len(sizes), n, dtype=torch.float64).index_add_(0, group_of_row, dy_cpu.double())

    assert y.dtype == dtype and db.dtype == dtype and db.shape == bias.shape
    tol = TOLERANCE[dtype]
    for out, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert _rel_err(out, ref) < tol
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert torch.equal(db[g], torch.zeros_like(db[g])), f"group {g} has no rows: db must be exactly 0"


def test_bias_kernels_write_every_element_of_poisoned_outputs():
    from xorl_kernels.expert_gemm.triton_kernels import grouped_bias_grad

    sizes, k, n = [3, 0, 40, 7], 24, 70
    x, w, dy = _inputs(sizes, k, n, torch.float32, seed=5)
    bias = torch.randn(len(sizes), n, generator=torch.Generator().manual_seed(6))
    group_sizes = torch.tensor(sizes)
    y_ref, _, _ = _float64_loop(x, w, sizes, dy)
    group_of_row = torch.repeat_interleave(torch.arange(len(sizes)), group_sizes)
    x, w, bias, dy, group_sizes = to_triton(x, w, bias, dy, group_sizes)
    y = grouped_gemm_forward(x, w, group_sizes, out=torch.full((x.shape[0], n), float("nan"), device=x.device),
                             bias=bias)
    db = grouped_bias_grad(dy, group_sizes, torch.float32, out=torch.full_like(bias, float("nan")))
    assert _rel_err(y, y_ref + bias.cpu().double()[group_of_row]) < 1e-5
    db_ref = torch.zeros(len(sizes), n, dtype=torch.float64).index_add_(0, group_of_row, dy.cpu().double())
    assert _rel_err(db, db_ref) < 1e-5 and torch.equal(db[1].cpu(), torch.zeros(n))


def test_kernels_write_every_element_of_poisoned_outputs():
    """NaN-filled outputs: any row, column or zero-row group the kernels skip stays NaN and fails."""
    sizes = [3, 0, 40, 1, 0, 17]
    x, w, dy = _inputs(sizes, 40, 50, torch.float32, seed=11)
    y_ref, dx_ref, dw_ref = _float64_loop(x, w, sizes, dy)
    x, w, dy, group_sizes = to_triton(x, w, dy, torch.tensor(sizes, dtype=torch.int32))

    y = grouped_gemm_forward(x, w, group_sizes, out=torch.full(y_ref.shape, float("nan"), device=x.device))
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
    x_wide, w_t, dy_t, group_sizes = to_triton(
        torch.randn(sum(sizes), 70, generator=gen),
        torch.randn(3, 36, 40, generator=gen),
        torch.randn(36, sum(sizes), generator=gen),
        torch.tensor(sizes),
    )
    x = x_wide[:, 3:43]  # [35, 40], row stride 70
    w = w_t.transpose(1, 2)  # [3, 40, 36], non-contiguous
    dy = dy_t.T  # [35, 36], column-major
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_gemm(x, w, group_sizes, backend="triton")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x_cpu, w_cpu = x.detach().cpu(), w.detach().cpu()
    y_ref, dx_ref, dw_ref = _float64_loop(x_cpu, w_cpu, sizes, dy.cpu())
    assert _rel_err(y, y_ref) < 1e-5 and _rel_err(dx, dx_ref) < 1e-5 and _rel_err(dw, dw_ref) < 1e-5

    # y.sum() hands backward an expanded dy (all strides 0).
    dx, dw = torch.autograd.grad(grouped_gemm(x, w, group_sizes, backend="triton").sum(), (x, w))
    _, dx_ref, dw_ref = _float64_loop(x_cpu, w_cpu, sizes, torch.ones(sum(sizes), 36))
    assert _rel_err(dx, dx_ref) < 1e-5 and _rel_err(dw, dw_ref) < 1e-5


def test_autocast_casts_inputs_like_linear():
    sizes = [5, 0, 12]
    x, w, _ = _inputs(sizes, 20, 18, torch.float32, seed=8)
    y_ref, _, _ = _float64_loop(x.bfloat16(), w.bfloat16(), sizes, torch.zeros(17, 18))
    x, w, group_sizes = to_triton(x, w, torch.tensor(sizes))
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = grouped_gemm(x, w, group_sizes, backend="triton")
    assert y.dtype == torch.bfloat16 and _rel_err(y, y_ref) < 1e-2


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
def test_bad_inputs_raise_clear_errors(make, error, match, backend, monkeypatch):
    x, w, group_sizes = make()
    if backend == "triton":
        # On a GPU the size values are checked only on request (a host sync): ask for it.
        monkeypatch.setenv("XORL_CHECK_GROUP_SIZES", "1")
        x, w, group_sizes = to_triton(x, w, group_sizes)
    with pytest.raises(error, match=match):
        grouped_gemm(x, w, group_sizes, backend=backend)


def test_dispatch(monkeypatch):
    cpu = torch.randn(2, 2)
    assert _resolve_backend(None, cpu) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what conftest.py sets on a machine without a GPU
    assert _resolve_backend("triton", cpu) == "triton"
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


H100_SHARED_MEMORY_BYTES = 227 * 1024


def compile_for_sm90() -> dict:
    """Compile the kernels for sm_90 with the GPU tile configs, no GPU needed (ptxas ships with triton).

    Runs in a subprocess with the interpreter off. Pointers and strides carry the 16-byte
    divisibility the launcher would see for real MoE shapes. Returns per-kernel shared memory and
    whether the K loop was software-pipelined (async copies).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xorl_kernels.expert_gemm import triton_kernels as kernels

    def build(kernel, pointers, unit_strides, aligned, constexprs, cfg):
        names = kernel.arg_names
        signature = {}
        for name in names:
            if name in pointers:
                signature[name] = "*bf16"
            elif name == "sizes_ptr":
                signature[name] = "*i32"
            elif name in constexprs or name in unit_strides:
                signature[name] = "constexpr"
            else:
                signature[name] = "i32"
        constants = {**constexprs, **{name: 1 for name in unit_strides}}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(kernel, signature, constants, attrs=attrs)
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        return {"shared": compiled.metadata.shared, "pipelined": "async_copy" in compiled.asm["ttgir"]}

    m, n, k, groups = 32768, 14336, 4096, 8  # Mixtral-8x7B up-projection, top-2 of 16K tokens
    out = {}
    cfg = kernels.forward_config(m, n, k, groups, torch.bfloat16)
    fwd_constexprs = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_G=16,
        GROUP_M=cfg.group_m,
        EVEN_K=True,
        INPUT_PRECISION="tf32",
        DOT_IN_FP32=False,
        HAS_BIAS=False,
    )
    fwd_pointers = ("a_ptr", "b_ptr", "c_ptr", "bias_ptr")
    aligned = ["a_ptr", "b_ptr", "c_ptr", "sizes_ptr", "N", "K", "stride_am", "stride_bg", "stride_cm"]
    for name, unit_b in (("forward", "stride_bn"), ("dgrad", "stride_bk")):
        other_b = "stride_bk" if unit_b == "stride_bn" else "stride_bn"
        out[name] = build(
            kernels._grouped_gemm_fwd_kernel,
            fwd_pointers,
            ("stride_ak", unit_b, "stride_cn"),
            aligned + [other_b],
            fwd_constexprs,
            cfg,
        )
    out["forward_bias"] = build(kernels._grouped_gemm_fwd_kernel, fwd_pointers,
                                ("stride_ak", "stride_bn", "stride_cn", "stride_bias_n"),
                                aligned + ["stride_bk", "stride_bias_g"], {**fwd_constexprs, "HAS_BIAS": True}, cfg)
    cfg = kernels.weight_grad_config(m, n, k, groups, torch.bfloat16)
    wgrad_constexprs = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_G=16,
        INPUT_PRECISION="tf32",
        DOT_IN_FP32=False,
    )
    out["wgrad"] = build(
        kernels._grouped_gemm_wgrad_kernel,
        ("x_ptr", "dy_ptr", "dw_ptr"),
        ("stride_xk", "stride_dyn", "stride_wn"),
        ["x_ptr", "dy_ptr", "dw_ptr", "sizes_ptr", "N", "K", "stride_xm", "stride_dym", "stride_wg", "stride_wk"],
        wgrad_constexprs,
        cfg,
    )
    return out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu tests run the kernels for real")
def test_kernels_compile_for_h100_with_pipelined_k_loop():
    """The interpreter accepts code the GPU compiler rejects: compile for sm_90 to catch that."""
    code = (
        "import json, tests.unit.kernels.test_expert_gemm as t\n"
        "try:\n    print(json.dumps(t.compile_for_sm90()))\n"
        "except (ImportError, TypeError) as e:\n    print('API', e); raise SystemExit(3)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = REPO
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip(f"this triton's AOT compile API differs: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    for kernel, info in stats.items():
        assert info["pipelined"], f"{kernel}: K loop not software-pipelined"
        assert 0 < info["shared"] <= H100_SHARED_MEMORY_BYTES, f"{kernel}: {info['shared']} B shared memory"


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
