"""flash_attn / flash_attn_with_lse and the ring-step pieces against float64 naive attention.

The naive attention (tests/support/attention_oracle.py) builds one dense [total_q, total_k] mask from document
ids and positions (independent of the reference's per-document loop and of the kernels' block logic)
and differentiates through plain torch in float64 on the CPU. Triton kernels run compiled on CUDA
tensors where a GPU exists and under TRITON_INTERPRET=1 on CPU tensors elsewhere
(tests/support/triton_helpers.py), so their shapes stay small; their outputs are NaN-poisoned before the
kernels write them.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.attention_oracle import (
    F64,
    check_packed,
    dense_attention,
    finite_lse_loss,
    loss_weights,
    poison_outputs,
    rel_err,
    token_meta,
    zigzag_shard_meta,
)
from tests.support.triton_helpers import to_triton, triton_device
from xorl_kernels.attention.merge import merge_attn_states
from xorl_kernels.attention.op import (
    flash_attn,
    flash_attn_backward,
    flash_attn_bwd_preprocess,
    flash_attn_forward,
    flash_attn_with_lse,
)


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch)


# -- reference backend (fast): every layout and mask against the naive float64 attention ----------


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_batched_gqa(dtype, causal):
    torch.manual_seed(0)
    b, s_q, s_k, hq, hk, d = 2, 37, 45, 6, 2, 16
    q, k, v = torch.randn(b, s_q, hq, d), torch.randn(b, s_k, hk, d), torch.randn(b, s_k, hk, d)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_with_lse(*leaves, causal=causal, backend="reference")
    assert out.shape == (b, s_q, hq, d) and lse.shape == (b, hq, s_q)
    assert lse.dtype == (F64 if dtype == F64 else torch.float32)
    w_out, w_lse = loss_weights(out.shape, lse.shape)
    grads = torch.autograd.grad(finite_lse_loss(out, lse, w_out, w_lse), leaves)

    ref_leaves = [t.to(F64).requires_grad_() for t in (q, k, v)]
    packed = [t.reshape(-1, *t.shape[2:]) for t in ref_leaves]
    cu_q, cu_k = torch.arange(b + 1) * s_q, torch.arange(b + 1) * s_k
    doc_q, p_q = token_meta(cu_q, None)
    doc_k, p_k = token_meta(cu_k, None)
    ref_out, ref_lse = dense_attention(*packed, doc_q, doc_k, p_q, p_k, causal, 1 / math.sqrt(d))
    ref_out = ref_out.view(b, s_q, hq, d)
    ref_lse = ref_lse.view(hq, b, s_q).transpose(0, 1)
    ref_grads = torch.autograd.grad(finite_lse_loss(ref_out, ref_lse, w_out, w_lse), ref_leaves)
    tol = 1e-12 if dtype == F64 else 1e-5
    assert rel_err(out, ref_out) < tol and rel_err(lse, ref_lse) < tol
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) < tol
    # SDPA agrees too (an anchor independent of the naive code above).
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.to(F64).transpose(1, 2) for t in (q, k, v)), is_causal=causal, enable_gqa=True
    ).transpose(1, 2)
    assert rel_err(out, sdpa) < tol


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_reference_varlen_positions_and_empty_rows(dtype):
    torch.manual_seed(1)
    # Uneven documents with different q/k lengths; document 3 has no keys (its query rows are empty).
    cu_q = torch.tensor([0, 7, 40, 41, 44, 70], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 31, 36, 36, 60], dtype=torch.int32)
    q, k, v = torch.randn(70, 4, 16), torch.randn(60, 2, 16), torch.randn(60, 2, 16)
    tol = 1e-12 if dtype == F64 else 1e-5
    for causal in (False, True):
        check_packed("reference", dtype, q, k, v, cu_q, cu_k, causal, tol=tol)
    pos_q = torch.cat([torch.randperm(int(n)) + 3 for n in cu_q[1:] - cu_q[:-1]]).int()
    pos_k = torch.cat([torch.randperm(int(n)) + 5 for n in cu_k[1:] - cu_k[:-1]]).int()
    out, lse, grads = check_packed("reference", dtype, q, k, v, cu_q, cu_k, True, pos_q, pos_k, tol=tol)
    empty = torch.isneginf(lse)
    assert empty.any() and (out.transpose(0, 1)[empty] == 0).all()


def test_dispatch_and_errors(monkeypatch):
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 3, 16)
    with pytest.raises(ValueError, match="heads of k/v"):
        flash_attn(q, k, k)
    with pytest.raises(ValueError, match="batch must be 1"):
        flash_attn(torch.randn(2, 4, 2, 16), *(torch.randn(2, 4, 2, 16),) * 2, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="one entry per token"):
        flash_attn(q, q, q, causal=True, q_positions=torch.arange(5), k_positions=torch.arange(8))
    with pytest.raises(ValueError, match="end at the token count"):
        flash_attn(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="backend"):
        flash_attn(q, q, q, backend="cuda")
    # CPU tensors default to torch's CPU flash kernel (tests/unit/kernels/test_attention_cpu_flash.py checks
    # the pick); XORL_FORCE_REFERENCE sends them to the reference.
    monkeypatch.setenv("XORL_FORCE_REFERENCE", "1")
    out = flash_attn(q, q, q, causal=True)
    assert out.shape == q.shape and torch.isfinite(out).all()


# -- Triton kernels under the interpreter --------------------------------------------------------


@pytest.mark.parametrize(
    "b,s_q,s_k,hq,hk,d,causal",
    [(2, 48, 48, 4, 2, 16, True), (1, 40, 56, 2, 2, 32, False), (1, 33, 33, 2, 1, 64, True)],
)
def test_triton_batched(poisoned, b, s_q, s_k, hq, hk, d, causal):
    torch.manual_seed(2)
    q, k, v = torch.randn(b, s_q, hq, d), torch.randn(b, s_k, hk, d), torch.randn(b, s_k, hk, d)
    cu_q, cu_k = torch.arange(b + 1) * s_q, torch.arange(b + 1) * s_k
    packed = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    # Batched call (its own layout handling) must equal the packed call, which is checked against naive.
    out_b, lse_b = flash_attn_forward(*to_triton(q, k, v), causal=causal, backend="triton")
    out, lse, _ = check_packed("triton", torch.float32, *packed, cu_q.int(), cu_k.int(), causal)
    assert torch.equal(out_b.reshape(out.shape), out.detach())
    assert torch.equal(lse_b, lse.detach().view(hq, b, s_q).transpose(0, 1))


def test_triton_varlen_uneven(poisoned):
    torch.manual_seed(3)
    cu_q = torch.tensor([0, 7, 40, 41, 44, 70], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 31, 36, 36, 60], dtype=torch.int32)  # document 3 has no keys
    q, k, v = torch.randn(70, 4, 32), torch.randn(60, 2, 32), torch.randn(60, 2, 32)
    for causal in (False, True):
        out, lse, _ = check_packed("triton", torch.float32, q, k, v, cu_q, cu_k, causal)
        assert torch.isneginf(lse[:, 41:44]).all() and (out[41:44] == 0).all()


@pytest.mark.parametrize("q_rank,k_rank,docs", [(1, 1, [32, 16]), (0, 1, [32, 16]), (1, 0, [128, 64])])
def test_triton_zigzag_step(poisoned, q_rank, k_rank, docs):
    """One ring step of zig-zag CP (P=2): q of one rank against k/v of another, true positions.
    Long chunks ([128, 64]) give mask-free, masked and skipped tiles in one launch."""
    torch.manual_seed(4)
    world, total = 2, sum(docs)
    full_q, full_k, full_v = torch.randn(total, 2, 16), torch.randn(total, 1, 16), torch.randn(total, 1, 16)
    iq, pos_q, cu = zigzag_shard_meta(docs, world, q_rank)
    ik, pos_k, _ = zigzag_shard_meta(docs, world, k_rank)
    out, lse, _ = check_packed(
        "triton", torch.float32, full_q[iq], full_k[ik], full_v[ik], cu, cu, True, pos_q, pos_k
    )
    if (q_rank, k_rank) == (0, 1):  # chunk 0 of each document precedes all of rank 1's keys
        assert torch.isneginf(lse[:, :8]).all() and (out[:8] == 0).all()


def test_triton_arbitrary_positions(poisoned):
    """Unsorted positions with repeats and gaps: the loop bounds derived from positions stay exact."""
    torch.manual_seed(8)
    cu_q = torch.tensor([0, 50, 90], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 100], dtype=torch.int32)
    q, k, v = torch.randn(90, 2, 16), torch.randn(100, 2, 16), torch.randn(100, 2, 16)
    pos_q = torch.cat([torch.randint(0, 60, (50,)), torch.randint(0, 30, (40,))]).int()
    pos_k = torch.cat([torch.sort(torch.randint(0, 60, (70,))).values, torch.randint(10, 40, (30,))]).int()
    check_packed("triton", torch.float32, q, k, v, cu_q, cu_k, True, pos_q, pos_k)


def test_triton_bf16(poisoned):
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 64, 2, 64), torch.randn(1, 64, 2, 64), torch.randn(1, 64, 2, 64)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    check_packed("triton", torch.bfloat16, q[0], k[0], v[0], cu, cu, True, tol=1e-2)


@pytest.mark.parametrize("backend", ["reference", "torch_cpu", "triton"])
def test_zigzag_ring_decomposition(poisoned, backend):
    """All ring steps of every rank, merged with merge_attn_states, equal monolithic causal
    attention; the per-step backward with the global lse/delta (lse in the loss too) accumulated
    into fp32 buffers equals the monolithic gradients. This is exactly how ring attention uses
    flash_attn_forward / flash_attn_bwd_preprocess / flash_attn_backward."""
    torch.manual_seed(6)
    docs, world, hq, hk, d = [32, 16], 2, 2, 1, 16
    total = sum(docs)
    q, k, v = torch.randn(total, hq, d), torch.randn(total, hk, d), torch.randn(total, hk, d)
    cu_full = torch.tensor([0, 32, 48], dtype=torch.int32)
    ref_leaves = [t.to(F64).requires_grad_() for t in (q, k, v)]
    doc, pos = token_meta(cu_full, None)
    ref_out, ref_lse = dense_attention(*ref_leaves, doc, doc, pos, pos, True, 1 / math.sqrt(d))
    w_out, w_lse = loss_weights(ref_out.shape, ref_lse.shape)
    ref_grads = torch.autograd.grad(finite_lse_loss(ref_out, ref_lse, w_out, w_lse), ref_leaves)

    dev = triton_device() if backend == "triton" else torch.device("cpu")
    q, k, v, w_out, w_lse = (t.to(dev) for t in (q, k, v, w_out, w_lse))
    shards = [tuple(t.to(dev) for t in zigzag_shard_meta(docs, world, r)) for r in range(world)]
    kw = dict(causal=True, backend=backend)
    merged = []
    for iq, pos_q, cu in shards:
        acc_out, acc_lse = None, None
        for ik, pos_k, _ in shards:
            out, lse = flash_attn_forward(
                q[iq], k[ik], v[ik], cu_seqlens=cu, q_positions=pos_q, k_positions=pos_k, **kw
            )
            if acc_out is None:
                acc_out, acc_lse = out.float(), lse
            else:
                acc_out, acc_lse = merge_attn_states(acc_out, acc_lse, out, lse)
        merged.append((acc_out, acc_lse))
    for (iq, _, _), (out, lse) in zip(shards, merged):
        iq = iq.cpu()
        assert rel_err(out, ref_out[iq]) < 1e-5 and rel_err(lse, ref_lse[:, iq]) < 1e-5

    dq = torch.zeros(total, hq, d, device=dev)
    dk = torch.zeros(total, hk, d, device=dev)
    dv = torch.zeros(total, hk, d, device=dev)
    for (iq, pos_q, cu), (out, lse) in zip(shards, merged):
        do = w_out[iq].float()
        delta = flash_attn_bwd_preprocess(out, do) - w_lse[:, iq].float()  # dlse enters through delta
        dq_acc = torch.zeros(len(iq), hq, d, device=dev)
        for ik, pos_k, _ in shards:
            dk_acc, dv_acc = torch.zeros(len(ik), hk, d, device=dev), torch.zeros(len(ik), hk, d, device=dev)
            flash_attn_backward(
                do, q[iq], k[ik], v[ik], out, lse, delta, cu_seqlens=cu, q_positions=pos_q,
                k_positions=pos_k, dq_accum=dq_acc, dk_accum=dk_acc, dv_accum=dv_acc, **kw,
            )
            dk[ik] += dk_acc
            dv[ik] += dv_acc
        dq[iq] = dq_acc
    for name, g, ref in zip("qkv", (dq, dk, dv), ref_grads):
        assert rel_err(g, ref) < 1e-5, f"d{name}"


def test_triton_backward_accumulates(poisoned):
    """flash_attn_backward adds into caller fp32 buffers (random start values, not zeros)."""
    torch.manual_seed(7)
    q, k, v, do = to_triton(*(torch.randn(1, 40, 2, 16) for _ in range(4)))
    out, lse = flash_attn_forward(q, k, v, causal=True, backend="triton")
    delta = flash_attn_bwd_preprocess(out, do, backend="triton")
    ref_delta = (out.double() * do.double()).sum(-1).transpose(1, 2)
    assert delta.shape == (1, 2, 40) and rel_err(delta, ref_delta) < 1e-6
    packed_delta = flash_attn_bwd_preprocess(out[0], do[0], backend="triton")
    assert packed_delta.shape == (2, 40) and rel_err(packed_delta, ref_delta[0]) < 1e-6
    fresh = flash_attn_backward(do, q, k, v, out, lse, delta, causal=True, backend="triton")
    starts = [torch.randn(t.shape, device=t.device) for t in (q, k, v)]
    accs = [s.clone() for s in starts]
    returned = flash_attn_backward(
        do, q, k, v, out, lse, delta, causal=True, backend="triton",
        dq_accum=accs[0], dk_accum=accs[1], dv_accum=accs[2],
    )
    ref = flash_attn_backward(*(t.double().cpu() for t in (do, q, k, v, out, lse, delta)), causal=True,
                              backend="reference")
    for acc, ret, start, g, r in zip(accs, returned, starts, fresh, ref):
        assert ret is acc
        assert rel_err(g, r) < 1e-5
        assert rel_err(acc - start, r) < 1e-5


def test_dkdv_head_splits_fill_an_h100():
    """The dK/dV grid is split over query-head slices only while the key blocks alone are too few."""
    from xorl_kernels.attention.bwd_triton import dkdv_head_splits

    # 32 q / 4 kv heads at 4k tokens: 4 * (32 + 1) programs without slices, 132 SMs.
    splits = dkdv_head_splits(4096, 1, 4, 8, sms=132)
    assert 8 % splits == 0 and 4 * (32 + 1) * splits >= 4 * 132 and splits > 1
    assert dkdv_head_splits(4096, 1, 4, 1, sms=132) == 1  # MHA: nothing to split
    assert dkdv_head_splits(131072, 1, 8, 4, sms=132) == 1  # long context: key blocks fill it alone
    assert dkdv_head_splits(16, 1, 1, 6, sms=132) == 6  # tiny: one query head per program


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_triton_dkdv_head_slices(poisoned, monkeypatch, splits):
    """GQA group of 4 split into 1, 2 or 4 slices of query heads: varlen documents with zig-zag
    positions (masked, mask-free and skipped tiles), lse in the loss, fp32 accumulators with random
    start values. Every split must give the float64 gradients."""
    from xorl_kernels.attention import bwd_triton as flash_attn_bwd_triton

    monkeypatch.setattr(flash_attn_bwd_triton, "dkdv_head_splits", lambda *args: splits)
    torch.manual_seed(11)
    docs, world = [64, 32], 2
    total = sum(docs)
    full_q, full_k, full_v = torch.randn(total, 4, 16), torch.randn(total, 1, 16), torch.randn(total, 1, 16)
    iq, pos_q, cu = zigzag_shard_meta(docs, world, 1)
    ik, pos_k, _ = zigzag_shard_meta(docs, world, 0)
    q, k, v = full_q[iq], full_k[ik], full_v[ik]
    check_packed("triton", torch.float32, q, k, v, cu, cu, True, pos_q, pos_k)

    meta = dict(causal=True, cu_seqlens=cu, q_positions=pos_q, k_positions=pos_k)
    dev_meta = {**meta, **dict(zip(("cu_seqlens", "q_positions", "k_positions"), to_triton(cu, pos_q, pos_k)))}
    q, k, v, do = to_triton(q, k, v, torch.randn(q.shape))
    out, lse = flash_attn_forward(q, k, v, backend="triton", **dev_meta)
    delta = flash_attn_bwd_preprocess(out, do, backend="triton")
    starts = [torch.randn(t.shape, device=t.device) for t in (q, k, v)]
    accs = [t.clone() for t in starts]
    flash_attn_backward(do, q, k, v, out, lse, delta, dq_accum=accs[0], dk_accum=accs[1], dv_accum=accs[2],
                        backend="triton", **dev_meta)
    ref = flash_attn_backward(*(t.double().cpu() for t in (do, q, k, v, out, lse, delta)), backend="reference",
                              **meta)
    for name, acc, start, r in zip("qkv", accs, starts, ref):
        assert rel_err(acc - start, r) < 1e-5, f"d{name} accumulated"


# -- compiled Triton on a GPU (skipped on CPU) -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_gpu_triton_zigzag_varlen(poisoned, dtype, head_dim):
    """Autotuned kernels on CUDA: a zig-zag step over uneven packed documents, GQA, lse in the loss,
    then the same step's backward accumulated into fp32 buffers (autotune must not double-add)."""
    torch.manual_seed(9)
    docs, world = [1024, 512, 256], 4
    total = sum(docs)
    q, k, v = torch.randn(total, 8, head_dim), torch.randn(total, 2, head_dim), torch.randn(total, 2, head_dim)
    iq, pos_q, cu = zigzag_shard_meta(docs, world, 2)
    ik, pos_k, _ = zigzag_shard_meta(docs, world, 1)
    q, k, v = q[iq], k[ik], v[ik]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    kw = dict(causal=True, cu_seqlens=cu.cuda(), q_positions=pos_q.cuda(), k_positions=pos_k.cuda())
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_with_lse(*leaves, **kw)
    w_out, w_lse = loss_weights(out.shape, lse.shape)
    grads = torch.autograd.grad(finite_lse_loss(out, lse, w_out.cuda(), w_lse.cuda()), leaves)

    ref_leaves = [t.to(dtype).to(F64).requires_grad_() for t in (q, k, v)]
    doc, _ = token_meta(cu, None)
    ref_out, ref_lse = dense_attention(*ref_leaves, doc, doc, pos_q.long(), pos_k.long(), True, head_dim**-0.5)
    ref_grads = torch.autograd.grad(finite_lse_loss(ref_out, ref_lse, w_out, w_lse), ref_leaves)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~finite)
    assert rel_err(out.cpu(), ref_out) < tol and rel_err(lse.cpu()[finite], ref_lse[finite]) < tol
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g.cpu(), ref) < tol

    plain = [t.detach() for t in leaves]
    do = w_out.to("cuda", dtype)
    delta = flash_attn_bwd_preprocess(out.detach(), do) - w_lse.cuda().float()
    starts = [torch.randn(t.shape, device="cuda") for t in plain]
    accs = [s.clone() for s in starts]
    flash_attn_backward(do, *plain, out.detach(), lse.detach(), delta, dq_accum=accs[0], dk_accum=accs[1],
                        dv_accum=accs[2], **kw)
    for acc, start, ref in zip(accs, starts, ref_grads):
        assert rel_err((acc - start).cpu(), ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, None])
def test_gpu_gqa_dkdv_head_slices(poisoned, monkeypatch, splits):
    """32 q / 4 kv heads (Llama-3-70B's ratio), bf16, two causal documents, compiled and autotuned:
    the dK/dV kernel with no slices, 2 slices and the planned ones (here one query head per program)
    against float64."""
    from xorl_kernels.attention import bwd_triton as flash_attn_bwd_triton

    if splits is not None:
        monkeypatch.setattr(flash_attn_bwd_triton, "dkdv_head_splits", lambda *args: splits)
    torch.manual_seed(12)
    cu = torch.tensor([0, 512, 768], dtype=torch.int32)
    q, k, v = torch.randn(768, 32, 128), torch.randn(768, 4, 128), torch.randn(768, 4, 128)
    check_packed("triton", torch.bfloat16, q, k, v, cu, cu, True, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_triton_batched_vs_sdpa(causal):
    torch.manual_seed(10)
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn(q, k, v, causal=causal)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double().transpose(1, 2))
    assert rel_err(out, ref.transpose(1, 2)) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r.transpose(1, 2)) < 1e-2
