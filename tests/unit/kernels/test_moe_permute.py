"""permute_tokens / unpermute_tokens against an independent float64 loop, forward and gradients,
on the torch path and on the Triton kernels (compiled on a GPU, the interpreter on CPU; see
tests/support/triton_helpers.py). Inputs are made on the CPU, the references computed there."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_helpers import triton_device
from xorl_kernels.moe_permute import op as permute_mod
from xorl_kernels.moe_permute.op import permute_tokens, unpermute_tokens


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def loop_permute(x, expert_ids, num_experts):
    """Independent float64 reference: rows per expert in ascending (token, k) order."""
    rows, counts = [], []
    num_tokens, top_k = expert_ids.shape
    for e in range(num_experts):
        members = [(t, k) for t in range(num_tokens) for k in range(top_k) if int(expert_ids[t, k]) == e]
        counts.append(len(members))
        rows.extend(x[t] for t, _ in members)
    x_sorted = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
    return x_sorted, torch.tensor(counts)


def loop_unpermute(y_sorted, row_map, weights):
    out = []
    for t in range(row_map.shape[0]):
        acc = torch.zeros_like(y_sorted[0])
        for k in range(row_map.shape[1]):
            w = 1.0 if weights is None else weights[t, k]
            acc = acc + w * y_sorted[int(row_map[t, k])]
        out.append(acc)
    return torch.stack(out)


def make_case(num_tokens, top_k, num_experts, hidden, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    # Distinct experts per token, like a top-k router.
    expert_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, expert_ids, weights


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every buffer the op allocates starts as NaN (floats) or a huge negative index (ints)."""

    def poisoned(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan") if dtype.is_floating_point else -(2**62))

    monkeypatch.setattr(permute_mod, "new_empty", poisoned)


@pytest.fixture(params=["torch", "triton"])
def dev(request, monkeypatch) -> torch.device:
    """The device each test puts its inputs on: the CPU for the torch path, triton_device() for the
    Triton kernels (forced, so a GPU machine runs them rather than the csrc kernels)."""
    if request.param == "triton":
        monkeypatch.setattr(permute_mod, "_backend", lambda t, requested: "triton")
        return triton_device()
    return torch.device("cpu")


def test_roundtrip_with_unit_weights_is_exact(dev):
    x, ids, _ = (t.to(dev) for t in make_case(37, 1, 5, 24))
    x_sorted, row_map, counts = permute_tokens(x, ids, 5)
    assert torch.equal(unpermute_tokens(x_sorted, row_map, torch.ones(37, 1, device=dev)), x)
    assert torch.equal(unpermute_tokens(x_sorted, row_map), x)
    # top-k > 1 with one-hot weights: each token's row comes back bit for bit.
    x, ids, _ = (t.to(dev) for t in make_case(37, 3, 6, 24, seed=1))
    one_hot = torch.zeros(37, 3).scatter_(1, torch.randint(0, 3, (37, 1)), 1.0).to(dev)
    x_sorted, row_map, _ = permute_tokens(x, ids, 6)
    assert torch.equal(unpermute_tokens(x_sorted, row_map, one_hot), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_loop(dev, dtype):
    num_tokens, top_k, num_experts, hidden = 29, 3, 7, 40
    x, ids, w = make_case(num_tokens, top_k, num_experts, hidden, dtype)
    x_sorted, row_map, counts = permute_tokens(x.to(dev), ids.to(dev), num_experts)
    x_sorted, row_map, counts = x_sorted.cpu(), row_map.cpu(), counts.cpu()
    ref_sorted, ref_counts = loop_permute(x.double(), ids, num_experts)
    assert row_map.dtype == torch.int64 and row_map.shape == (num_tokens, top_k)
    assert torch.equal(counts, ref_counts)
    assert torch.equal(x_sorted.double(), ref_sorted)  # a pure copy: exact
    for t in range(num_tokens):
        for k in range(top_k):
            assert torch.equal(x_sorted[row_map[t, k]], x[t])

    y_sorted = torch.randn(num_tokens * top_k, hidden).to(dtype)
    y_sorted_poisoned_out = unpermute_tokens(y_sorted.to(dev), row_map.to(dev), w.to(dev))
    ref = loop_unpermute(y_sorted.double(), row_map, w.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert y_sorted_poisoned_out.dtype == dtype
    assert rel_err(y_sorted_poisoned_out, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_float64_loop(dev, dtype):
    num_tokens, top_k, num_experts, hidden = 23, 2, 5, 33
    x, ids, w = make_case(num_tokens, top_k, num_experts, hidden, dtype, seed=3)
    scale = torch.randn(num_tokens * top_k, hidden).to(dtype)  # a per-row "expert" so rows differ
    grad_out = torch.randn(num_tokens, hidden).to(dtype)

    x1, w1 = x.to(dev, copy=True).requires_grad_(), w.to(dev, copy=True).requires_grad_()
    x_sorted, row_map, _ = permute_tokens(x1, ids.to(dev), num_experts)
    out = unpermute_tokens(x_sorted * scale.to(dev), row_map, w1)
    out.backward(grad_out.to(dev))
    row_map = row_map.cpu()

    x2, w2 = x.double().requires_grad_(), w.double().requires_grad_()
    # Reference: for every slot, x[t] * scale[row of that slot], weighted sum over k.
    ref_sorted, _ = loop_permute(x2, ids, num_experts)
    ref = loop_unpermute(ref_sorted * scale.double(), row_map, w2)
    ref.backward(grad_out.double())

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol
    assert rel_err(x1.grad, x2.grad) < tol
    assert rel_err(w1.grad, w2.grad) < tol
    assert w1.grad.dtype == w.dtype


def test_unpermute_is_deterministic(dev):
    x, ids, w = (t.to(dev) for t in make_case(64, 4, 8, 48, seed=5))
    x_sorted, row_map, _ = permute_tokens(x, ids, 8)
    outs = [unpermute_tokens(x_sorted, row_map, w) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_experts_with_no_tokens_and_empty_input(dev):
    x = make_case(10, 2, 6, 16)[0].to(dev)
    ids = torch.tensor([[4, 1]] * 10, device=dev)  # experts 0, 2, 3, 5 receive nothing
    x_sorted, row_map, counts = permute_tokens(x, ids, 6)
    assert counts.tolist() == [0, 10, 0, 0, 10, 0]
    assert torch.equal(x_sorted[:10], x) and torch.equal(x_sorted[10:], x)
    empty = torch.randn(0, 16, device=dev, requires_grad=True)
    xs, rm, c = permute_tokens(empty, torch.zeros(0, 2, dtype=torch.int64, device=dev), 6)
    out = unpermute_tokens(xs, rm, torch.rand(0, 2, device=dev))
    out.sum().backward()
    assert xs.shape == (0, 16) and c.tolist() == [0] * 6 and empty.grad.shape == (0, 16)


def test_clear_errors():
    x, ids, w = make_case(5, 2, 4, 8)
    with pytest.raises(ValueError, match="x must be"):
        permute_tokens(x[None], ids, 4)
    with pytest.raises(ValueError, match="expert_ids must be"):
        permute_tokens(x, ids[:3], 4)
    with pytest.raises(TypeError, match="integer"):
        permute_tokens(x, ids.float(), 4)
    with pytest.raises(ValueError, match=r"\[0, num_experts=3\)"):
        permute_tokens(x, ids.clamp_min(3), 3)
    x_sorted, row_map, _ = permute_tokens(x, ids, 4)
    with pytest.raises(ValueError, match="rows but row_map"):
        unpermute_tokens(x_sorted[:-1], row_map, w)
    with pytest.raises(ValueError, match="weights must have"):
        unpermute_tokens(x_sorted, row_map, w[:, :1])
    with pytest.raises(ValueError, match="int64"):
        unpermute_tokens(x_sorted, row_map.int(), w)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", ["csrc", "triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference_without_host_sync(dtype, gpu_backend, monkeypatch):
    from xorl_kernels import has_cuda_ext

    if gpu_backend == "csrc" and not has_cuda_ext():
        pytest.skip("xorl_kernels._C not built")
    num_tokens, top_k, num_experts, hidden = 4096, 8, 64, 512
    x, ids, w = make_case(num_tokens, top_k, num_experts, hidden, dtype, seed=7)
    x, ids, w = x.cuda().requires_grad_(), ids.cuda(), w.cuda().requires_grad_()
    grad_out = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x_sorted, row_map, counts = permute_tokens(x, ids, num_experts, backend=gpu_backend)
        out = unpermute_tokens(x_sorted * 1.5, row_map, w, backend=gpu_backend)
        out.backward(grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x_ref, w_ref = x.detach().cpu().double().requires_grad_(), w.detach().cpu().double().requires_grad_()
    xs_ref, rm_ref, c_ref = permute_tokens(x_ref, ids.cpu(), num_experts)
    ref = unpermute_tokens(xs_ref * 1.5, rm_ref, w_ref)
    ref.backward(grad_out.cpu().double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.equal(row_map.cpu(), rm_ref) and torch.equal(counts.cpu(), c_ref)
    assert rel_err(out.cpu(), ref) < tol
    assert rel_err(x.grad.cpu(), x_ref.grad) < tol
    assert rel_err(w.grad.cpu(), w_ref.grad) < tol
