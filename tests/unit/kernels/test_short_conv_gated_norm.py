"""causal_conv1d (xorl_kernels/short_conv) and gated_rms_norm (xorl_kernels/rmsnorm/gated.py).

The conv's oracle is the convolution written as a sum of shifted copies, per document, in float64
(tests/support/linear_attention_oracle.py), differentiated by autograd: y and the gradients of x,
weight, bias and the initial state. Both backends run (Triton compiled on a GPU, interpreted on CPU,
NaN-poisoned buffers), fp32 within 1e-5 and bf16 within 1e-2. Packed documents must not leak into
each other, a document split in two with the first part's tail as the second's initial state (the
context-parallel neighbour) must equal the whole, and the op must give transformers'
causal_conv1d_fn. The gated norm is checked against its formula in float64 and against
transformers' Qwen3NextRMSNormGated module.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.linear_attention_oracle import F64, poison_outputs, rel_err, shifted_causal_conv
from tests.support.triton_helpers import to_triton
from xorl_kernels import causal_conv1d, gated_rms_norm

BACKENDS = ["triton", "reference"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch)


def _conv_inputs(batch, seq, dim, width, docs, seed, bias=True, state=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, dim, generator=gen)
    w = torch.randn(dim, width, generator=gen) * 0.5
    b = torch.randn(dim, generator=gen) if bias else None
    init = torch.randn(docs, dim, width - 1, generator=gen) if state else None
    return [x, w, b, init]


def _conv_run(inputs, cu, activation, backend, dtype, dy):
    """The op on the inputs (x in ``dtype``; weight, bias and state fp32, as a model holds them)."""
    leaves = [None if t is None else t.clone() for t in inputs]
    leaves[0] = leaves[0].to(dtype)
    if backend == "triton":
        leaves = [None if t is None else to_triton(t) for t in leaves]
        cu = None if cu is None else to_triton(cu)
    leaves = [None if t is None else t.requires_grad_() for t in leaves]
    y = causal_conv1d(leaves[0], leaves[1], leaves[2], activation, cu, leaves[3], backend=backend)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((y.float() * dy.to(y.device)).sum(), present)
    return y.cpu(), [g.cpu() for g in grads]


def _conv_oracle(inputs, cu, activation, dtype, dy):
    leaves = [None if t is None else t.detach().to(F64).requires_grad_() for t in inputs]
    leaves[0] = inputs[0].to(dtype).to(F64).requires_grad_()
    y = shifted_causal_conv(leaves[0], leaves[1], leaves[2], activation, leaves[3], cu)
    present = [t for t in leaves if t is not None]
    return y, torch.autograd.grad((y * dy.to(F64)).sum(), present)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_packed_documents_with_initial_state(poisoned, backend, dtype):
    # an empty document, documents shorter than the kernel, one spanning several token blocks
    cu = torch.tensor([0, 1, 1, 3, 23, 41], dtype=torch.int32)
    inputs = _conv_inputs(1, 41, 40, 4, 5, seed=1)  # 40 channels: two interpreter channel blocks
    dy = torch.randn(1, 41, 40, generator=torch.Generator().manual_seed(2))
    ref_y, ref_grads = _conv_oracle(inputs, cu, "silu", dtype, dy)
    y, grads = _conv_run(inputs, cu, "silu", backend, dtype, dy)
    assert y.dtype == dtype
    assert rel_err(y, ref_y) < TOL[dtype], f"y: {rel_err(y, ref_y):.2e}"
    for name, g, r in zip(("x", "weight", "bias", "initial_state"), grads, ref_grads):
        assert rel_err(g, r) < TOL[dtype], f"d{name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_batched_without_bias_state_or_activation(poisoned, backend):
    inputs = _conv_inputs(2, 19, 24, 3, 2, seed=3, bias=False, state=False)
    dy = torch.randn(2, 19, 24, generator=torch.Generator().manual_seed(4))
    ref_y, ref_grads = _conv_oracle(inputs, None, None, torch.float32, dy)
    y, grads = _conv_run(inputs, None, None, backend, torch.float32, dy)
    assert rel_err(y, ref_y) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_no_leak_across_documents(poisoned, backend):
    """Changing one document's tokens changes nothing in the next one, forward or backward."""
    cu = torch.tensor([0, 17, 30])
    inputs = _conv_inputs(1, 30, 16, 4, 2, seed=5, state=False)
    dy = torch.randn(1, 30, 16, generator=torch.Generator().manual_seed(6))
    y, grads = _conv_run(inputs, cu, "silu", backend, torch.float32, dy)
    changed = [t.clone() if t is not None else None for t in inputs]
    changed[0][:, :17] = torch.randn(1, 17, 16, generator=torch.Generator().manual_seed(7))
    y2, grads2 = _conv_run(changed, cu, "silu", backend, torch.float32, dy)
    assert torch.equal(y[:, 17:], y2[:, 17:]) and not torch.equal(y[:, :17], y2[:, :17])
    assert torch.equal(grads[0][:, 17:], grads2[0][:, 17:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_split_document_with_the_neighbours_tail_as_initial_state(poisoned, backend):
    """The context-parallel form: the second half of a document, started from the first half's
    last W-1 inputs, gives the whole document's outputs; the initial state's gradient is what the
    second half's outputs send back to those inputs."""
    inputs = _conv_inputs(1, 34, 16, 4, 1, seed=8, state=False)
    x, w, b = inputs[:3]
    dy = torch.randn(1, 34, 16, generator=torch.Generator().manual_seed(9))
    whole, _ = _conv_run([x, w, b, None], None, "silu", backend, torch.float32, dy)
    tail = x[:, 14:17].transpose(1, 2).contiguous()  # [1, dim, W-1]
    second, grads = _conv_run([x[:, 17:], w, b, tail], None, "silu", backend, torch.float32, dy[:, 17:])
    assert rel_err(second, whole[:, 17:]) < 1e-6
    leaf = x.clone().requires_grad_()
    y = shifted_causal_conv(leaf.double(), w.double(), b.double())[:, 17:]
    (d_x,) = torch.autograd.grad((y * dy[:, 17:].double()).sum(), leaf)
    assert rel_err(grads[3], d_x[:, 14:17].transpose(1, 2)) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_matches_transformers_causal_conv1d_fn(poisoned, backend):
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    conv = torch.nn.Conv1d(24, 24, 4, groups=24, bias=False, padding=3)
    x = torch.randn(2, 13, 24, generator=torch.Generator().manual_seed(10))
    ref = causal_conv1d_fn(x.transpose(1, 2), conv.weight.squeeze(1), None, activation="silu").transpose(1, 2)
    w = conv.weight.detach()  # nn.Conv1d's [dim, 1, W] is taken as is
    if backend == "triton":
        x, w = to_triton(x), to_triton(w)
    assert rel_err(causal_conv1d(x, w, backend=backend), ref) < 1e-6


def test_conv_custom_op_passes_opcheck():
    x, w, b, init = (t.requires_grad_() for t in _conv_inputs(1, 9, 6, 4, 2, seed=11))
    cu = torch.tensor([0, 4, 9])
    torch.library.opcheck(torch.ops.xorl.causal_conv1d.default, (x, w, b, init, cu, "silu", "reference"))
    torch.library.opcheck(torch.ops.xorl.causal_conv1d.default, (x, w, None, None, None, None, "reference"))


def test_conv_argument_errors_name_the_fix():
    x, w, b, init = _conv_inputs(2, 9, 6, 4, 2, seed=12)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, w[:5])
    with pytest.raises(ValueError, match="activation must be one of"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="initial_state must be"):
        causal_conv1d(x, w, initial_state=init[..., :2])
    with pytest.raises(ValueError, match="batch dim must be 1"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 9]))


# -- the gated RMSNorm ---------------------------------------------------------------------------


def _gated64(x, z, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 37), (1, 64), (7, 2, 128)])
def test_gated_rms_norm(poisoned, backend, dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x, z = torch.randn(shape, generator=gen) * 2, torch.randn(shape, generator=gen)
    w = 1 + 0.3 * torch.randn(shape[-1], generator=gen)
    dy = torch.randn(shape, generator=gen)
    ref_leaves = [t.to(dtype).double().requires_grad_() for t in (x, z, w)]
    ref = _gated64(*ref_leaves, 1e-6)
    ref_grads = torch.autograd.grad((ref * dy.double()).sum(), ref_leaves)
    leaves = [t.to(dtype) for t in (x, z, w)]
    leaves = [(to_triton(t) if backend == "triton" else t).requires_grad_() for t in leaves]
    y = gated_rms_norm(*leaves, 1e-6, backend=backend)
    grads = torch.autograd.grad((y.float() * dy.to(y.device)).sum(), leaves)
    assert y.dtype == dtype and rel_err(y, ref) < TOL[dtype]
    for name, g, r in zip(("x", "gate", "weight"), grads, ref_grads):
        assert rel_err(g, r) < TOL[dtype], f"d{name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers_module(poisoned, backend, dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    norm = Qwen3NextRMSNormGated(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(48, generator=torch.Generator().manual_seed(1)))
    gen = torch.Generator().manual_seed(2)
    x, z = (torch.randn(20, 48, generator=gen).to(dtype) for _ in range(2))
    dy = torch.randn(20, 48, generator=gen)
    hf_leaves = [x.clone().requires_grad_(), z.clone().requires_grad_()]
    ref = norm(*hf_leaves)
    ref_grads = torch.autograd.grad((ref.float() * dy).sum(), [*hf_leaves, norm.weight])
    leaves = [x, z, norm.weight.detach()]
    leaves = [(to_triton(t) if backend == "triton" else t.clone()).requires_grad_() for t in leaves]
    y = gated_rms_norm(*leaves, 1e-6, backend=backend)
    grads = torch.autograd.grad((y.float() * dy.to(y.device)).sum(), leaves)
    # The same roundings as transformers: fp32 equal to round-off, bf16 to one unit in a few elements.
    # Triton's interpreter truncates fp32 -> bf16 casts (compiled Triton rounds to nearest even), so
    # its three roundings drift by up to three units there: only the brief's bf16 bound then.
    interpreted = backend == "triton" and not torch.cuda.is_available()
    assert rel_err(y, ref) < (1e-6 if dtype == torch.float32 else 2e-2 if interpreted else 4e-3)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < TOL[dtype]


def test_gated_rms_norm_custom_op_passes_opcheck():
    x, z, w = (torch.randn(4, 6).requires_grad_(), torch.randn(4, 6).requires_grad_(),
               torch.randn(6).requires_grad_())
    torch.library.opcheck(torch.ops.xorl.gated_rms_norm.default, (x, z, w, 1e-6, "reference"))
