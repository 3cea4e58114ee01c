"""Float64 oracles and input builders for the linear-attention ops (xorl_kernels/gated_delta,
short_conv, the gated RMSNorm), shared by tests/unit/kernels/test_gated_delta_rule.py and
test_short_conv_gated_norm.py (and by the context-parallel tests that build on them).

The oracles are written from the definitions, token by token, independent of the ops' chunked
references and of the kernels: ``recurrent_gated_delta`` is the recurrence itself (a loop over
tokens with the state reset at every document start), ``shifted_causal_conv`` the convolution as
a sum of shifted copies. Both are plain torch, differentiable by autograd in float64 on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.support.attention_oracle import rel_err  # noqa: F401 (re-exported for the tests)
from xorl_kernels.gated_delta import triton_common as gated_delta_common
from xorl_kernels.rmsnorm import gated_triton as gated_norm_triton
from xorl_kernels.short_conv import triton_kernels as short_conv_triton

F64 = torch.float64


def poison_outputs(monkeypatch) -> None:
    """Every buffer the gated delta, short conv and gated norm kernels allocate starts as NaN: a row,
    state or gradient a kernel forgets to write fails the test."""

    def alloc(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    for module in (gated_delta_common, short_conv_triton, gated_norm_triton):
        monkeypatch.setattr(module, "alloc_output", alloc)


def gated_delta_inputs(batch, seq, heads_k, heads_v, dk, dv, seed, docs=None, with_state=True):
    """CPU float32 q, k, v, g, beta (and an initial state [docs or batch, heads_v, dk, dv]) drawn
    from a seeded generator, with O(1) activations. g follows the layer's own formula,
    -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads_k, dk, generator=gen)
    k = torch.randn(batch, seq, heads_k, dk, generator=gen)
    v = torch.randn(batch, seq, heads_v, dv, generator=gen)
    a_log = torch.empty(heads_v).uniform_(-1.5, 0.5, generator=gen)
    dt_bias = torch.randn(heads_v, generator=gen)
    g = -a_log.exp() * F.softplus(torch.randn(batch, seq, heads_v, generator=gen) + dt_bias)
    beta = torch.sigmoid(torch.randn(batch, seq, heads_v, generator=gen))
    n = docs if docs is not None else batch
    state = torch.randn(n, heads_v, dk, dv, generator=gen) * 0.5 if with_state else None
    return q, k, v, g, beta, state


def _l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_gated_delta(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, use_qk_l2norm=True):
    """(out [batch, seq, heads_v, dv], final state [docs, heads_v, dk, dv]) token by token, in the
    inputs' dtype (give float64 leaves for the oracle). Batched rows are documents unless
    cu_seqlens (batch 1) says where the packed documents start."""
    batch, seq, heads_k, dk = q.shape
    heads_v, dv = v.shape[2], v.shape[3]
    group = heads_v // heads_k
    if cu_seqlens is None:
        bounds = [(b, 0, seq) for b in range(batch)]
    else:
        cu = [int(x) for x in cu_seqlens]
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    kv_head = torch.arange(heads_v) // group
    q, k = q[:, :, kv_head] * scale, k[:, :, kv_head]
    rows, finals = {}, []
    for n, (b, bos, eos) in enumerate(bounds):
        state = (initial_state[n] if initial_state is not None
                 else torch.zeros(heads_v, dk, dv, dtype=q.dtype))
        for t in range(bos, eos):
            state = state * g[b, t].exp()[:, None, None]
            kt = k[b, t]
            remembered = torch.einsum("hkv,hk->hv", state, kt)
            state = state + kt[:, :, None] * ((v[b, t] - remembered) * beta[b, t][:, None])[:, None, :]
            rows[(b, t)] = torch.einsum("hkv,hk->hv", state, q[b, t])
        finals.append(state)
    out = torch.stack([torch.stack([rows[(b, t)] for t in range(seq)]) for b in range(batch)])
    return out, torch.stack(finals)


def shifted_causal_conv(x, weight, bias=None, activation="silu", initial_state=None, cu_seqlens=None):
    """y [batch, seq, dim] = act(bias + sum_i weight[:, i] * x[t - (W-1) + i]) inside each document;
    positions before a document's start read its ``initial_state`` [docs, dim, W-1] (or 0)."""
    batch, seq, dim = x.shape
    width = weight.shape[1]
    if cu_seqlens is None:
        bounds = [(b, 0, seq) for b in range(batch)]
    else:
        cu = [int(c) for c in cu_seqlens]
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    rows = {}
    for n, (b, bos, eos) in enumerate(bounds):
        before = (initial_state[n] if initial_state is not None
                  else torch.zeros(dim, width - 1, dtype=x.dtype))
        for t in range(bos, eos):
            acc = bias.clone() if bias is not None else torch.zeros(dim, dtype=x.dtype)
            for i in range(width):
                src = t - (width - 1) + i
                tap = x[b, src] if src >= bos else before[:, src - bos + width - 1]
                acc = acc + weight[:, i] * tap
            rows[(b, t)] = acc
    z = torch.stack([torch.stack([rows[(b, t)] for t in range(seq)]) for b in range(batch)])
    return F.silu(z) if activation in ("silu", "swish") else z
