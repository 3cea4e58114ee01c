"""gated_delta_rule (xorl_kernels/gated_delta) against the recurrence itself and against transformers.

The oracle (tests/support/linear_attention_oracle.py) runs the recurrence token by token in float64
and is differentiated by autograd: out, final state and the gradients of q, k, v, g, beta and the
initial state. The chunked reference (the CPU path) must match it to float64 round-off on any
chunk size; the Triton kernels run on small shapes (compiled on a GPU, under TRITON_INTERPRET=1 on
CPU; tests/support/triton_helpers.py) with NaN-poisoned buffers, fp32 within 1e-5 and bf16 within
1e-2 of the oracle on the same (rounded) inputs. Packed documents must equal each document run
alone (the state resets), GQA head sharing must equal explicitly repeated heads, and the op must
give transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.linear_attention_oracle import (
    F64,
    gated_delta_inputs,
    poison_outputs,
    recurrent_gated_delta,
    rel_err,
)
from tests.support.triton_helpers import to_triton
from xorl_kernels import gated_delta_rule

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch)


def _loss_weights(out_shape, final_shape, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_shape, generator=gen), torch.randn(final_shape, generator=gen)


def _oracle(inputs, scale, cu, l2norm, w_out, w_final):
    leaves = [None if t is None else t.detach().to(F64).requires_grad_() for t in inputs]
    out, final = recurrent_gated_delta(*leaves[:5], scale, leaves[5], cu, l2norm)
    loss = (out * w_out.to(F64)).sum() + (final * w_final.to(F64)).sum()
    present = [t for t in leaves if t is not None]
    return out, final, dict(zip([n for n, t in zip(NAMES, leaves) if t is not None],
                                torch.autograd.grad(loss, present)))


def _run_op(inputs, scale, cu, l2norm, w_out, w_final, backend, chunk_size, dtype=None):
    """The op on ``inputs`` (q, k, v, beta cast to ``dtype``; g and the state stay fp32, as a model
    hands them) on the backend's device -> out, final and the inputs' gradients, on the CPU."""
    cast = [dtype, dtype, dtype, None, dtype, None] if dtype is not None else [None] * 6
    leaves = [None if t is None else t.detach().to(c or t.dtype) for t, c in zip(inputs, cast)]
    if backend == "triton":
        leaves = [None if t is None else to_triton(t) for t in leaves]
        cu = None if cu is None else to_triton(cu)
    leaves = [None if t is None else t.requires_grad_() for t in leaves]
    out, final = gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True,
                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, chunk_size=chunk_size,
                                  backend=backend)
    loss = (out.float() * w_out.to(out.device)).sum() + (final * w_final.to(final.device)).sum()
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, present)
    return out.cpu(), final.cpu(), {n: gr.cpu() for n, gr in zip([n for n, t in zip(NAMES, leaves) if t is not None],
                                                                  grads)}, leaves


def _compare(inputs, scale, cu, l2norm, backend, chunk_size, tol, dtype=None):
    out_shape = inputs[2].shape
    docs = inputs[0].shape[0] if cu is None else len(cu) - 1
    w_out, w_final = _loss_weights(out_shape, (docs, inputs[2].shape[2], inputs[0].shape[3], inputs[2].shape[3]))
    rounded = list(inputs)
    if dtype is not None:  # the oracle sees the inputs the op sees
        rounded = [t if t is None or i in (3, 5) else t.to(dtype) for i, t in enumerate(inputs)]
    ref_out, ref_final, ref_grads = _oracle(rounded, scale, cu, l2norm, w_out, w_final)
    out, final, grads, _ = _run_op(inputs, scale, cu, l2norm, w_out, w_final, backend, chunk_size, dtype)
    assert out.dtype == (dtype or inputs[0].dtype) and final.dtype in (torch.float32, F64)
    assert rel_err(out, ref_out) < tol, f"out: {rel_err(out, ref_out):.2e}"
    assert rel_err(final, ref_final) < tol, f"final state: {rel_err(final, ref_final):.2e}"
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) < tol, f"d{name}: {rel_err(grads[name], ref):.2e}"
    return out, final, grads


# -- the chunked reference (the CPU path) against the recurrence ------------------------------------


@pytest.mark.parametrize("case", [
    dict(batch=2, seq=19, heads=(2, 4), dims=(8, 6), cu=None, chunk=5, l2norm=True, state=True),
    dict(batch=1, seq=33, heads=(3, 3), dims=(5, 7), cu=[0, 7, 7, 20, 33], chunk=8, l2norm=False, state=False),
    dict(batch=1, seq=26, heads=(1, 2), dims=(6, 4), cu=[0, 1, 26], chunk=64, l2norm=True, state=True),
    dict(batch=3, seq=9, heads=(2, 2), dims=(4, 4), cu=None, chunk=1, l2norm=True, state=True),
])
def test_reference_matches_the_recurrence_in_float64(case):
    cu = None if case["cu"] is None else torch.tensor(case["cu"])
    docs = None if cu is None else len(cu) - 1
    inputs = gated_delta_inputs(case["batch"], case["seq"], *case["heads"], *case["dims"], seed=case["seq"],
                                docs=docs, with_state=case["state"])
    inputs = [None if t is None else t.to(F64) for t in inputs]
    _compare(inputs, 0.41, cu, case["l2norm"], "reference", case["chunk"], 1e-12)


def test_reference_fp32_within_1e5_of_the_float64_recurrence():
    cu = torch.tensor([0, 17, 40, 41, 64], dtype=torch.int32)
    inputs = gated_delta_inputs(1, 64, 2, 4, 16, 12, seed=3, docs=4)
    _compare(inputs, 16 ** -0.5, cu, True, "reference", 16, 1e-5)


# -- Triton (compiled on a GPU, interpreted on CPU) -------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_packed_gqa_with_initial_state(poisoned, dtype, tol):
    cu = torch.tensor([0, 5, 5, 23, 45], dtype=torch.int32)  # an empty document and a partial last chunk
    inputs = gated_delta_inputs(1, 45, 2, 4, 16, 12, seed=11, docs=4)
    _compare(inputs, 0.25, cu, True, "triton", 16, tol, dtype)


def test_triton_batched_odd_head_dims_without_l2norm(poisoned):
    # d_k = 20 and d_v = 72 pad inside the tiles, d_v spans two value blocks; no initial state.
    inputs = gated_delta_inputs(2, 21, 3, 3, 20, 72, seed=5, with_state=False)
    q, k = (torch.nn.functional.normalize(t, dim=-1) for t in inputs[:2])  # O(1) without the kernel's norm
    _compare([q, k, *inputs[2:]], 0.3, None, False, "triton", 32, 1e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_documents_equal_each_document_alone(poisoned, backend):
    lengths = [9, 20, 3]
    cu = torch.tensor([0, 9, 29, 32])
    q, k, v, g, beta, state = gated_delta_inputs(1, 32, 1, 2, 16, 16, seed=2, docs=3)
    w_out, w_final = _loss_weights(v.shape, state.shape)
    out, final, grads, _ = _run_op([q, k, v, g, beta, state], 0.25, cu, True, w_out, w_final, backend, 16)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = [t[:, bos:eos] for t in (q, k, v, g, beta)] + [state[n:n + 1]]
        o, f, gr, _ = _run_op(piece, 0.25, None, True, w_out[:, bos:eos], w_final[n:n + 1], backend, 16)
        assert lengths[n] == eos - bos
        assert rel_err(out[:, bos:eos], o) < 1e-6 and rel_err(final[n:n + 1], f) < 1e-6
        for name in NAMES[:5]:
            assert rel_err(grads[name][:, bos:eos], gr[name]) < 1e-6, name
        assert rel_err(grads["initial_state"][n:n + 1], gr["initial_state"]) < 1e-6


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gqa_equals_repeated_key_heads(poisoned, backend):
    q, k, v, g, beta, state = gated_delta_inputs(1, 20, 2, 4, 16, 16, seed=4)
    w_out, w_final = _loss_weights(v.shape, state.shape)
    shared = _run_op([q, k, v, g, beta, state], 0.25, None, True, w_out, w_final, backend, 16)
    qr, kr = (t.repeat_interleave(2, dim=2) for t in (q, k))  # value head h reads key head h // 2
    repeated = _run_op([qr, kr, v, g, beta, state], 0.25, None, True, w_out, w_final, backend, 16)
    assert rel_err(shared[0], repeated[0]) < 1e-6 and rel_err(shared[1], repeated[1]) < 1e-6
    for name in ("q", "k"):
        summed = repeated[2][name].unflatten(2, (2, 2)).sum(3)
        assert rel_err(shared[2][name], summed) < 1e-6, name
    for name in ("v", "g", "beta", "initial_state"):
        assert rel_err(shared[2][name], repeated[2][name]) < 1e-6, name


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_only_the_final_state_in_the_loss(poisoned, backend):
    """out unused: its gradient is absent, the final state's alone drives every input gradient."""
    inputs = gated_delta_inputs(1, 20, 1, 1, 16, 16, seed=8)
    w_out, w_final = _loss_weights(inputs[2].shape, inputs[5].shape)
    ref_out, ref_final, ref_grads = _oracle(inputs, 0.25, None, True, torch.zeros_like(w_out), w_final)
    leaves = [to_triton(t) if backend == "triton" else t.clone() for t in inputs]
    leaves = [t.requires_grad_() for t in leaves]
    _, final = gated_delta_rule(*leaves[:5], scale=0.25, initial_state=leaves[5], output_final_state=True,
                                use_qk_l2norm_in_kernel=True, chunk_size=16, backend=backend)
    grads = torch.autograd.grad((final * w_final.to(final.device)).sum(), leaves)
    for name, gr in zip(NAMES, grads):
        assert rel_err(gr, ref_grads[name]) < 1e-5, name


# -- transformers' own functions ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_matches_transformers_chunk_and_recurrent_functions(poisoned, backend):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = gated_delta_inputs(2, 30, 1, 2, 16, 16, seed=9)
    hf_leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    hf_out, hf_final = hf.torch_chunk_gated_delta_rule(
        *hf_leaves[:5], chunk_size=64, initial_state=hf_leaves[5], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    rec_out, rec_final = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(hf_out, rec_out) < 1e-5 and rel_err(hf_final, rec_final) < 1e-5
    w_out, w_final = _loss_weights(v.shape, state.shape)
    hf_grads = torch.autograd.grad((hf_out * w_out).sum() + (hf_final * w_final).sum(), hf_leaves)
    out, final, grads, _ = _run_op([q, k, v, g, beta, state], None, None, True, w_out, w_final, backend, 16)
    assert rel_err(out, hf_out) < 1e-5 and rel_err(final, hf_final) < 1e-5
    for name, ref in zip(NAMES, hf_grads):
        assert rel_err(grads[name], ref) < 1e-5, name


# -- compiled Triton on a GPU at the published head shapes (skipped on CPU) -------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gpu_qwen35_head_dims_default_chunk(poisoned, dtype, tol):
    """d_k = d_v = 128 (Qwen3.5 / Qwen3-Next), the default chunks (32 tokens), uneven packed documents,
    GQA 2 -> 4 and an initial state: the compiled kernels against the float64 reference on the GPU
    (the token-by-token oracle is too slow at 2K tokens; the reference is held to it above)."""
    cu = torch.tensor([0, 700, 1500, 1501, 2048], dtype=torch.int32)
    inputs = [t.cuda() for t in gated_delta_inputs(1, 2048, 2, 4, 128, 128, seed=21, docs=4)]
    w_out, w_final = _loss_weights(inputs[2].shape, inputs[5].shape)
    rounded = [t if i in (3, 5) else t.to(dtype) for i, t in enumerate(inputs)]
    ref = _run_op([t.to(F64) for t in rounded], None, cu.cuda(), True, w_out, w_final, "reference", None)
    out, final, grads, _ = _run_op(inputs, None, cu.cuda(), True, w_out, w_final, "triton", None, dtype)
    assert rel_err(out, ref[0]) < tol and rel_err(final, ref[1]) < tol
    for name, r in ref[2].items():
        assert rel_err(grads[name], r) < tol, f"d{name}: {rel_err(grads[name], r):.2e}"


# -- the custom op and the argument checks ----------------------------------------------------------


def test_custom_op_passes_opcheck():
    q, k, v, g, beta, state = gated_delta_inputs(1, 10, 1, 2, 8, 8, seed=1)
    args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    torch.library.opcheck(torch.ops.xorl.gated_delta_rule.default,
                          (*args[:5], args[5][:1].repeat(2, 1, 1, 1).detach().requires_grad_(), cu, 0.3, True, 4,
                           "reference"))
    torch.library.opcheck(torch.ops.xorl.gated_delta_rule.default, (*args[:5], None, None, 0.3, False, 3, "reference"))


def test_argument_errors_name_the_fix():
    q, k, v, g, beta, state = gated_delta_inputs(2, 8, 2, 4, 8, 8, seed=1)
    with pytest.raises(ValueError, match="must divide heads_v"):
        gated_delta_rule(q[:, :, :1].expand(2, 8, 3, 8), k[:, :, :1].expand(2, 8, 3, 8), v, g, beta)
    with pytest.raises(ValueError, match="batch dim must be 1"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="initial_state must be"):
        gated_delta_rule(q, k, v, g, beta, initial_state=state[:1])
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule(q, k, v, g[..., :2], beta)
    with pytest.raises(ValueError, match="from 0 to the number of tokens"):
        gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="chunk_size must be one of"):
        gated_delta_rule(q, k, v, g, beta, chunk_size=64, backend="triton")
    with pytest.raises(TypeError, match="float64"):
        gated_delta_rule(*(t.double() for t in (q, k, v, g, beta)), backend="triton")
