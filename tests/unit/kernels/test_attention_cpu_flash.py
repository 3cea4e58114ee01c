"""flash_attn on CPU tensors: torch's CPU flash kernel (xorl_kernels/attention/cpu_flash.py) against
the float64 oracle, in the cases its contract adds on top of the kernel, and the dispatch that picks it.

The oracle is tests/support/attention_oracle.py's dense float64 attention (one [total_q, total_k]
mask from document ids and positions, differentiated by plain torch), independent of both the
reference's per-document loop and of this path. ``check_packed`` puts lse in the loss (so the
backward gets delta = rowsum(dO·O) - dlse, the spare-column path); the tests here also take the
loss through out only, where the backward hands the kernel the real output. The features
(windows, sinks, d_v != d_qk, zig-zag steps, ring decomposition) run on this backend too in
test_attention_features.py and test_flash_attn.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_oracle import (
    F64,
    check_packed,
    dense_attention,
    docs,
    make_inputs,
    rel_err,
    token_meta,
    zigzag_shard_meta,
)
from xorl_kernels.attention import cpu_flash
from xorl_kernels.attention.op import flash_attn, flash_attn_backward, flash_attn_bwd_preprocess, flash_attn_forward


def _case(name):
    """(q, k, v, sinks, cu_q, cu_k, causal, pos_q, pos_k, window) in float64, fresh from a seed per case."""
    if name == "batched causal gqa":  # one kernel call for the whole batch
        q, k, v, _ = make_inputs(1, 3 * 40, 3 * 40, 6, 2, 16, 16, sinks=False)
        return q, k, v, None, docs(40, 40, 40), docs(40, 40, 40), True, None, None, None
    if name == "uneven documents, empty key document":
        q, k, v, _ = make_inputs(2, 70, 60, 4, 2, 16, 16, sinks=False)
        cu_q, cu_k = torch.tensor([0, 7, 40, 41, 44, 70]).int(), torch.tensor([0, 20, 31, 36, 36, 60]).int()
        return q, k, v, None, cu_q, cu_k, True, None, None, None
    if name == "non-causal, q and k lengths differ":
        q, k, v, _ = make_inputs(3, 50, 64, 4, 4, 16, 16, sinks=False)
        return q, k, v, None, docs(20, 30), docs(40, 24), False, None, None, None
    if name == "zig-zag step, rows that see no key":  # q of ring rank 0 against k of rank 1
        q, k, v, _ = make_inputs(4, 48, 48, 4, 1, 16, 16, sinks=False)
        iq, pos_q, cu = zigzag_shard_meta([32, 16], 2, 0)
        ik, pos_k, _ = zigzag_shard_meta([32, 16], 2, 1)
        return q[iq], k[ik], v[ik], None, cu, cu, True, pos_q, pos_k, None
    if name == "window, sinks, d_qk 24 / d_v 16":
        q, k, v, s = make_inputs(5, 50, 50, 4, 2, 24, 16)
        return q, k, v, s, docs(24, 9, 17), docs(24, 9, 17), True, None, None, 7
    if name == "d_qk 16 / d_v 32, arbitrary positions":
        q, k, v, _ = make_inputs(6, 40, 40, 2, 2, 16, 32, sinks=False)
        gen = torch.Generator().manual_seed(6)
        pos = torch.randint(0, 30, (40,), generator=gen).int()
        return q, k, v, None, docs(25, 15), docs(25, 15), True, pos, pos, None
    if name == "equal documents, each its own positions":  # one batch only if the masks agree
        q, k, v, _ = make_inputs(7, 60, 60, 2, 1, 16, 16, sinks=False)
        gen = torch.Generator().manual_seed(7)
        pos = torch.cat([torch.randperm(20, generator=gen) for _ in range(3)]).int()
        return q, k, v, None, docs(20, 20, 20), docs(20, 20, 20), True, pos, pos, None
    raise KeyError(name)


CASES = ["batched causal gqa", "uneven documents, empty key document", "non-causal, q and k lengths differ",
         "zig-zag step, rows that see no key", "window, sinks, d_qk 24 / d_v 16",
         "d_qk 16 / d_v 32, arbitrary positions", "equal documents, each its own positions"]


@pytest.fixture
def backward_widths(monkeypatch):
    """The head dim of the value tensor every backward kernel call got (spare column: d_v + 1)."""
    widths = []
    real = cpu_flash._BACKWARD

    def spy(grad_out, q, k, v, *args, **kwargs):
        widths.append(v.shape[-1])
        return real(grad_out, q, k, v, *args, **kwargs)

    monkeypatch.setattr(cpu_flash, "_BACKWARD", spy)
    return widths


@pytest.mark.parametrize("case", CASES)
def test_lse_in_the_loss_matches_float64(case, backward_widths):
    q, k, v, s, cu_q, cu_k, causal, pos_q, pos_k, window = _case(case)
    check_packed("torch_cpu", torch.float32, q, k, v, cu_q, cu_k, causal, pos_q, pos_k, window=window, sinks=s)
    assert backward_widths and all(w == max(q.shape[-1], v.shape[-1] + 1) for w in backward_widths)


@pytest.mark.parametrize("case", CASES)
def test_loss_through_out_only_runs_the_kernel_on_the_real_output(case, backward_widths):
    """With the loss through out alone, delta is rowsum(dO·O): the kernel gets O at the inputs' width."""
    q, k, v, s, cu_q, cu_k, causal, pos_q, pos_k, window = _case(case)
    leaves = [t.float().requires_grad_() for t in (q, k, v)] + ([s.float().requires_grad_()] if s is not None else [])
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, q_positions=pos_q, k_positions=pos_k,
              window=window, sinks=leaves[3] if s is not None else None)
    out = flash_attn(*leaves[:3], **kw)  # backend=None: CPU tensors pick torch's CPU kernel
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    grads = torch.autograd.grad((out * w.float()).sum(), leaves)

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    doc_q, p_q = token_meta(cu_q, pos_q)
    doc_k, p_k = token_meta(cu_k, pos_k)
    ref_out, _ = dense_attention(*ref_leaves[:3], doc_q, doc_k, p_q, p_k, causal, q.shape[-1] ** -0.5, window,
                                 ref_leaves[3] if s is not None else None)
    ref_grads = torch.autograd.grad((ref_out * w).sum(), ref_leaves)
    assert rel_err(out, ref_out) < 1e-5
    for name, g, ref in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        assert rel_err(g, ref) < 1e-5, f"d{name}"
    assert backward_widths and all(wd == max(q.shape[-1], v.shape[-1]) for wd in backward_widths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["uneven documents, empty key document", "window, sinks, d_qk 24 / d_v 16"])
def test_half_precision_within_its_rounding(case, dtype):
    q, k, v, s, cu_q, cu_k, causal, pos_q, pos_k, window = _case(case)
    check_packed("torch_cpu", dtype, q, k, v, cu_q, cu_k, causal, pos_q, pos_k, window=window, sinks=s, tol=1e-2)


def test_ring_style_backward_with_accumulators():
    """The ring's call: the low-level backward with the output's own delta, adding into fp32
    accumulators that start at random values, equals the float64 reference backend's gradients."""
    q, k, v, _, cu, _, _, pos_q, pos_k, _ = _case("zig-zag step, rows that see no key")
    q, k, v = q.float(), k.float(), v.float()
    kw = dict(causal=True, cu_seqlens=cu, q_positions=pos_q, k_positions=pos_k)
    out, lse = flash_attn_forward(q, k, v, **kw)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    delta = flash_attn_bwd_preprocess(out, do)
    starts = [torch.randn(t.shape, generator=torch.Generator().manual_seed(11)) for t in (q, k, v)]
    accs = [t.clone() for t in starts]
    returned = flash_attn_backward(do, q, k, v, out, lse, delta, dq_accum=accs[0], dk_accum=accs[1],
                                   dv_accum=accs[2], **kw)
    ref = flash_attn_backward(*(t.double() for t in (do, q, k, v, out, lse, delta)), backend="reference", **kw)
    for name, acc, ret, start, r in zip("qkv", accs, returned, starts, ref):
        assert ret is acc and rel_err(acc - start, r) < 1e-5, f"d{name}"


def test_cpu_tensors_pick_the_kernel_and_the_reference_stays_reachable(monkeypatch):
    """backend=None on CPU: torch's kernel for fp32 / bf16, the reference for fp64 (the oracle's
    dtype) and for every call under XORL_FORCE_REFERENCE=1."""
    calls = []
    real = cpu_flash.cpu_flash_forward
    monkeypatch.setattr("xorl_kernels.attention.op.cpu_flash_forward", lambda p: calls.append(p) or real(p))
    q = torch.randn(1, 12, 2, 16)
    for dtype, expected in ((torch.float32, 1), (torch.bfloat16, 1), (F64, 0)):
        calls.clear()
        flash_attn(*(q.to(dtype),) * 3, causal=True)
        assert len(calls) == expected, dtype
    monkeypatch.setenv("XORL_FORCE_REFERENCE", "1")
    calls.clear()
    out = flash_attn(q, q, q, causal=True)
    assert not calls
    monkeypatch.delenv("XORL_FORCE_REFERENCE")
    assert torch.allclose(flash_attn(q, q, q, causal=True), out, atol=1e-6)
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_attn(q, q, q, backend="cpu")
