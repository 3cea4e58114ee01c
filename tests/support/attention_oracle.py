"""The float64 attention oracle and the input builders shared by the attention-kernel tests
(tests/unit/kernels/test_flash_attn.py, tests/unit/kernels/test_attention_features.py,
tests/unit/kernels/test_attention_kernel_costs.py).

The oracle builds one dense [total_q, total_k] mask from document ids and positions (independent of
attention/reference.py's per-document loop and of the kernels' block logic), with attention sinks as
one more column of the scores and a causal sliding window, and is differentiated by plain torch in
float64 on the CPU. ``check_packed`` runs a kernel (packed 3-D layout) against it, forward (out, lse)
and gradients, on inputs built on the CPU from a seeded generator (tests/support/triton_helpers.py moves them
to where Triton runs).
"""

from __future__ import annotations

import math

import torch

from tests.support.triton_helpers import triton_device
from xorl_kernels.attention import common
from xorl_kernels.attention.op import flash_attn_with_lse

F64 = torch.float64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on the CPU (a must be finite)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "result has NaN/inf"
    denom = b.norm()
    return float((a - b).norm() / (denom if denom > 0 else 1.0))


def dense_attention(q, k, v, doc_q, doc_k, pos_q, pos_k, causal, scale, window=None, sinks=None):
    """Dense float64 attention on packed q [Tq, Hq, Dqk], v [Tk, Hkv, Dv] -> out [Tq, Hq, Dv], lse [Hq, Tq].

    A query sees a key of its own document (and, causal, at a position <= its own; with ``window``
    W, at a position > its own - W); ``sinks`` [Hq] add one logit per head to every row's softmax
    denominator, with no value behind it."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    allowed = doc_q[:, None] == doc_k[None, :]
    if causal:
        allowed &= pos_k[None, :] <= pos_q[:, None]
    if window is not None:
        allowed &= pos_k[None, :] > pos_q[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more column per row: the head's sink logit, no value behind it
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, q.shape[0], 1)], -1)
        allowed = torch.cat([allowed, torch.ones_like(allowed[:, :1])], -1)
    empty = ~allowed.any(-1)  # rows that see no key (never with sinks)
    # logsumexp over an all -inf row has a NaN gradient; compute it on zeros there, then mask.
    lse_raw = torch.logsumexp(scores.masked_fill(empty[None, :, None], 0.0), -1)
    lse = lse_raw.masked_fill(empty[None, :], float("-inf"))
    probs = torch.exp(scores - lse_raw.masked_fill(empty[None, :], 0.0)[..., None])
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vv), lse


def docs(*lengths) -> torch.Tensor:
    """cu_seqlens (int32) of packed documents of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def token_meta(cu: torch.Tensor, positions: torch.Tensor | None):
    """Document id and position of every packed token."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths]) if positions is None else positions.long()
    return doc, pos


def zigzag_shard_meta(doc_lengths, world, rank):
    """Tokens rank ``rank`` holds under zig-zag (chunks r and 2P-1-r of every document): their
    indices in the packed sequence, their positions in their document, and their cu_seqlens."""
    index, positions, cu, offset = [], [], [0], 0
    for length in doc_lengths:
        chunk = length // (2 * world)
        for c in (rank, 2 * world - 1 - rank):
            index.append(torch.arange(offset + c * chunk, offset + (c + 1) * chunk))
            positions.append(torch.arange(c * chunk, (c + 1) * chunk))
        cu.append(cu[-1] + 2 * chunk)
        offset += length
    return torch.cat(index), torch.cat(positions).int(), torch.tensor(cu, dtype=torch.int32)


def make_inputs(seed, total_q, total_k, hq, hk, d_qk, d_v, sinks=True):
    """Packed float64 q [total_q, hq, d_qk], k [total_k, hk, d_qk], v [total_k, hk, d_v] and sinks [hq]
    (None with ``sinks=False``), from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, hq, d_qk, generator=gen, dtype=F64)
    k = torch.randn(total_k, hk, d_qk, generator=gen, dtype=F64)
    v = torch.randn(total_k, hk, d_v, generator=gen, dtype=F64)
    s = torch.randn(hq, generator=gen, dtype=F64) * 2 if sinks else None
    return q, k, v, s


def loss_weights(out_shape, lse_shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_shape, generator=gen, dtype=F64), torch.randn(lse_shape, generator=gen, dtype=F64)


def finite_lse_loss(out, lse, w_out, w_lse):
    """sum(out·w) + sum(lse·w) over rows with a finite lse (a loss that depends on lse too)."""
    lse_term = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * w_lse.to(lse.dtype)
    return (out * w_out.to(out.dtype)).sum() + lse_term.sum()


def poison_outputs(monkeypatch) -> None:
    """Kernel outputs start as NaN: a row a kernel forgets to write fails the test."""

    def alloc(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(common, "alloc_output", alloc)


def check_packed(backend, dtype, q, k, v, cu_q, cu_k, causal, pos_q=None, pos_k=None, *, window=None, sinks=None,
                 tol=1e-5, seed=1):
    """flash_attn_with_lse (packed 3-D) vs ``dense_attention`` in float64: out, lse, dq, dk, dv (and
    dsinks). Inputs are CPU tensors; the Triton backend gets them on triton_device(), the oracle
    keeps them on the CPU. ``seed`` draws the loss weights. Returns the kernel's out, lse and
    gradients (on its device)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    device = triton_device() if backend == "triton" else torch.device("cpu")
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.to(device, torch.float32 if dtype != F64 else F64).requires_grad_())
    on_dev = [None if t is None else t.to(device) for t in (cu_q, cu_k, pos_q, pos_k)]
    kw = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "q_positions", "k_positions"), on_dev), causal=causal)
    if window is not None:
        kw["window"] = window
    if sinks is not None:
        kw["sinks"] = leaves[3]
    out, lse = flash_attn_with_lse(*leaves[:3], backend=backend, **kw)
    w_out, w_lse = loss_weights(out.shape, lse.shape, seed)
    grads = torch.autograd.grad(finite_lse_loss(out, lse, w_out.to(device), w_lse.to(device)), leaves)

    ref_leaves = [t.detach().to(dtype).to(F64).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        ref_leaves.append(leaves[3].detach().cpu().to(F64).requires_grad_())
    doc_q, p_q = token_meta(cu_q, pos_q)
    doc_k, p_k = token_meta(cu_k, pos_k)
    ref_out, ref_lse = dense_attention(*ref_leaves[:3], doc_q, doc_k, p_q, p_k, causal, scale, window,
                                       ref_leaves[3] if sinks is not None else None)
    ref_grads = torch.autograd.grad(finite_lse_loss(ref_out, ref_lse, w_out, w_lse), ref_leaves)

    assert out.shape == ref_out.shape
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse)), "rows with no visible key differ"
    finite = torch.isfinite(ref_lse)
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse.cpu()[finite], ref_lse[finite]) < tol
    for name, g, ref in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        assert rel_err(g, ref) < tol, f"d{name}: {rel_err(g, ref)}"
    return out, lse, grads
