"""merge_attn_states against float64 attention over the concatenated key sets."""

from __future__ import annotations

import pytest
import torch

from xorl_kernels import merge_attn_states

F64 = torch.float64


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "result has NaN/inf"
    return float((a - b).norm() / b.norm())


def attend(q, k, v, allowed):
    """Batched float64 attention q [B, S, H, D], k/v [B, N, H, D], allowed [S, N] -> out, lse [B, H, S]."""
    scores = torch.einsum("bshd,bnhd->bhsn", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)
    lse_raw = torch.logsumexp(scores.masked_fill(empty[:, None], 0.0), -1)
    lse = lse_raw.masked_fill(empty, float("-inf"))
    probs = torch.exp(scores - lse_raw.masked_fill(empty, 0.0)[..., None])
    return torch.einsum("bhsn,bnhd->bshd", probs, v), lse


def split_case(seed, s=24, n_a=20, n_b=28, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, s, 3, 16, generator=gen, dtype=F64) * scale
    k = torch.randn(2, n_a + n_b, 3, 16, generator=gen, dtype=F64)
    v = torch.randn(2, n_a + n_b, 3, 16, generator=gen, dtype=F64)
    allowed = torch.rand(s, n_a + n_b, generator=gen) < 0.6
    allowed[:3] = False  # rows that see nothing anywhere
    allowed[3:6, n_a:] = False  # rows that see only set a
    allowed[6:9, :n_a] = False  # rows that see only set b
    return q, k, v, allowed, n_a


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: lse in the hundreds, exp would overflow unshifted
def test_merge_equals_attention_over_union(dtype, scale):
    q, k, v, allowed, n_a = split_case(0, scale=scale)
    ref_out, ref_lse = attend(q, k, v, allowed)
    out_a, lse_a = attend(q, k[:, :n_a], v[:, :n_a], allowed[:, :n_a])
    out_b, lse_b = attend(q, k[:, n_a:], v[:, n_a:], allowed[:, n_a:])
    out, lse = merge_attn_states(out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float())
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.isneginf(lse[:, :, :3]).all() and (out[:, :3] == 0).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert rel_err(out, ref_out) < 1e-6 and rel_err(lse[finite], ref_lse[finite]) < 1e-6


def test_merge_gradients_and_packed_layout():
    """Gradients through the merge (both sides, -inf rows included) match the union attention."""
    q, k, v, allowed, n_a = split_case(1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    gen = torch.Generator().manual_seed(2)
    w_out = torch.randn(q.shape, generator=gen, dtype=F64)
    w_lse = torch.randn(2, 3, q.shape[1], generator=gen, dtype=F64)

    def loss(out, lse):
        return (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()

    qq, kk, vv = leaves
    out_a, lse_a = attend(qq, kk[:, :n_a], vv[:, :n_a], allowed[:, :n_a])
    out_b, lse_b = attend(qq, kk[:, n_a:], vv[:, n_a:], allowed[:, n_a:])
    grads = torch.autograd.grad(loss(*merge_attn_states(out_a, lse_a, out_b, lse_b)), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(loss(*attend(*ref_leaves, allowed)), ref_leaves)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-10

    # Packed layout: out [total, heads, d] with lse [heads, total] gives the same numbers.
    out_p, lse_p = merge_attn_states(out_a[0].detach(), lse_a[0].detach(), out_b[0].detach(), lse_b[0].detach())
    out_ref, lse_ref = merge_attn_states(*(t.detach() for t in (out_a, lse_a, out_b, lse_b)))
    assert torch.equal(out_p, out_ref[0]) and torch.equal(lse_p, lse_ref[0])


def test_merge_rejects_mismatched_layouts():
    out = torch.randn(2, 5, 3, 8)
    with pytest.raises(ValueError, match="lse must be"):
        merge_attn_states(out, torch.randn(2, 5, 3), out, torch.randn(2, 5, 3))
