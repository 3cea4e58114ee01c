"""Plain-torch chunked gated delta rule, forward and backward (the CPU path; float64-capable).

The recurrence, per value head, with S a [d_k, d_v] state and q̂ = l2norm(q) * scale, k̂ = l2norm(k):

    S_t = exp(g_t) S_{t-1};   S_t += k̂_t (β_t (v_t - S_t^T k̂_t))^T;   o_t = S_t^T q̂_t

Chunked (C tokens, cumulative decay γ = cumsum(g) inside the chunk, Γ = exp(γ), S the state entering
the chunk). Writing every delta of the chunk at once gives a unit lower-triangular system:

    A_ij = β_i (k̂_i·k̂_j) exp(γ_i - γ_j)  (j < i),   T = (I + A)^-1
    U = T (β ⊙ V),   W = T (βΓ ⊙ K̂)                      (the "WY" form of the chunk's updates)
    Δ = U - W S                                          (the deltas actually written)
    O = (Q̂ ⊙ Γ) S + (Q̂ K̂^T ∘ M) Δ,   M_ij = exp(γ_i - γ_j) (j <= i)
    S' = exp(γ_C) S + (K̂ ⊙ exp(γ_C - γ))^T Δ

This is transformers' torch_chunk_gated_delta_rule (per document, with any chunk size) and the
algorithm the Triton kernels run; the backward below is its hand derivation, the same formulas the
Triton backward runs, so the kernels can be checked piece by piece. The chunk's incoming-state
gradient dS = exp(γ_C) dS' + (Q̂ ⊙ Γ)^T dO - W^T dΔ runs the scan backwards; the rest of each chunk's
gradients is local. GQA: value head h reads key head h // (heads_v // heads_k) (repeat_interleave,
as transformers); q̂ / k̂ gradients are summed over the value heads that share a key head and
taken through the l2norm backward (_qk_backward).

Layouts (packed): q, k [T, heads_k, d_k], v [T, heads_v, d_v], g, beta [T, heads_v],
initial_state [docs, heads_v, d_k, d_v]; documents from cu_seqlens (int64, host). Arithmetic in
float64 for float64 inputs, float32 otherwise; out in q's dtype, states in the arithmetic dtype.
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, as transformers' (and fla's) l2norm."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q, k, heads_v: int, scale: float, use_qk_l2norm: bool, dtype):
    """(q̂, k̂) [T, heads_v, d_k] in ``dtype``: normalised, q̂ scaled, key heads repeated to value heads."""
    group = heads_v // k.shape[1]
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return (q * scale).repeat_interleave(group, 1), k.repeat_interleave(group, 1)


def _chunk_terms(q, k, v, g, beta):
    """The per-chunk quantities, heads first: q, k [H, L, dk], v [H, L, dv], g, beta [H, L]."""
    gc = g.cumsum(-1)
    diff = gc[:, :, None] - gc[:, None, :]
    size = gc.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    # Mask before exp: the upper triangle's exponents are positive and could overflow.
    decay_incl = diff.masked_fill(~lower, float("-inf")).exp()
    decay_strict = diff.masked_fill(~strict, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    a = beta[..., None] * kk * decay_strict
    eye = torch.eye(size, dtype=q.dtype, device=q.device).expand_as(a)
    t = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    e = gc.exp()
    u = t @ (beta[..., None] * v)
    w = t @ ((beta * e)[..., None] * k)
    p = (q @ k.transpose(-1, -2)) * decay_incl
    return dict(gc=gc, e=e, el=(gc[:, -1:] - gc).exp(), decay_incl=decay_incl, decay_strict=decay_strict, kk=kk,
                a=a, t=t, u=u, w=w, p=p)


def _chunk_forward(c, q, k, state):
    """(out [H, L, dv], delta [H, L, dv], next state) of one chunk from its entering state."""
    delta = c["u"] - c["w"] @ state
    out = (q * c["e"][..., None]) @ state + c["p"] @ delta
    gl = c["gc"][:, -1]
    nxt = gl.exp()[:, None, None] * state + (k * c["el"][..., None]).transpose(-1, -2) @ delta
    return out, delta, nxt


def _docs(cu: torch.Tensor):
    return [(int(cu[n]), int(cu[n + 1])) for n in range(cu.numel() - 1)]


def _heads_first(x, s, e, dtype):
    return x[s:e].to(dtype).transpose(0, 1)


def gated_delta_forward_reference(q, k, v, g, beta, scale, initial_state, cu, use_qk_l2norm, chunk_size):
    """(out [T, heads_v, d_v] in q's dtype, final_state [docs, heads_v, d_k, d_v])."""
    dtype = compute_dtype(q, k, v, initial_state)
    heads_v, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    qh, kh = prepare_qk(q, k, heads_v, scale, use_qk_l2norm, dtype)
    out = torch.zeros(v.shape, dtype=dtype, device=v.device)
    finals = []
    for n, (bos, eos) in enumerate(_docs(cu)):
        state = (initial_state[n].to(dtype) if initial_state is not None
                 else torch.zeros(heads_v, dk, dv, dtype=dtype, device=v.device))
        for s in range(bos, eos, chunk_size):
            e = min(s + chunk_size, eos)
            qc, kc, vc = (_heads_first(x, s, e, dtype) for x in (qh, kh, v))
            c = _chunk_terms(qc, kc, vc, _heads_first(g, s, e, dtype), _heads_first(beta, s, e, dtype))
            o, _, state = _chunk_forward(c, qc, kc, state)
            out[s:e] = o.transpose(0, 1)
        finals.append(state)
    final = torch.stack(finals) if finals else v.new_zeros((0, heads_v, dk, dv), dtype=dtype)
    return out.to(q.dtype), final


def _chunk_backward(c, q, k, v, beta, state, delta, d_out, d_next):
    """Gradients of one chunk: (dq̂, dk̂, dv, dg, dbeta, d_state_in), all heads first."""
    e, el, gc, t, w = c["e"], c["el"], c["gc"], c["t"], c["w"]
    d_delta = c["p"].transpose(-1, -2) @ d_out + (k * el[..., None]) @ d_next
    d_state = (gc[:, -1].exp()[:, None, None] * d_next + (q * e[..., None]).transpose(-1, -2) @ d_out
               - w.transpose(-1, -2) @ d_delta)
    # O = (Q̂ ⊙ Γ) S + P Δ with P = Q̂ K̂^T ∘ M
    d_out_state = d_out @ state.transpose(-1, -2)  # [H, L, dk]
    ds = d_out @ delta.transpose(-1, -2)  # dP, before the mask and the decay
    dsm = ds * c["decay_incl"]
    dq = e[..., None] * d_out_state + dsm @ k
    d_ktilde = delta @ d_next.transpose(-1, -2)  # through S' = ... + (K̂ ⊙ el)^T Δ
    dk = dsm.transpose(-1, -2) @ q + el[..., None] * d_ktilde
    r = ds * c["p"]
    dgc = (q * e[..., None] * d_out_state).sum(-1) + r.sum(-1) - r.sum(-2)
    tj = (k * el[..., None] * d_ktilde).sum(-1)
    dgl = gc[:, -1].exp() * (state * d_next).sum((-1, -2)) + tj.sum(-1)
    dgc = dgc - tj
    # Δ = U - W S, U = T Bv, W = T Bk, T = (I + A)^-1
    d_w = -d_delta @ state.transpose(-1, -2)
    bv, bk = beta[..., None] * v, (beta * e)[..., None] * k
    d_bv, d_bk = t.transpose(-1, -2) @ d_delta, t.transpose(-1, -2) @ d_w
    d_t = d_delta @ bv.transpose(-1, -2) + d_w @ bk.transpose(-1, -2)
    dv = beta[..., None] * d_bv
    sk = (k * d_bk).sum(-1)
    dbeta = (v * d_bv).sum(-1) + e * sk
    dk = dk + (beta * e)[..., None] * d_bk
    dgc = dgc + beta * e * sk
    d_a = -(t.transpose(-1, -2) @ d_t @ t.transpose(-1, -2)).tril(-1)
    dbeta = dbeta + (d_a * c["kk"] * c["decay_strict"]).sum(-1)
    dkk = d_a * beta[..., None] * c["decay_strict"]
    dk = dk + dkk @ k + dkk.transpose(-1, -2) @ k
    r2 = d_a * c["a"]
    dgc = dgc + r2.sum(-1) - r2.sum(-2)
    dgc[:, -1] += dgl
    dg = dgc.flip(-1).cumsum(-1).flip(-1)  # γ = cumsum(g): dg_s = sum over t >= s of dγ_t
    return dq, dk, dv, dg, dbeta, d_state


def _qk_backward(x, d_expanded, use_qk_l2norm, dtype):
    """dx from the gradient of l2norm(x) repeated to the value heads: summed over the value heads
    sharing a key head, then through x̂ = x r, r = 1 / sqrt(|x|^2 + eps): dx = r (dx̂ - x̂ (x̂·dx̂)).
    (Explicit, not autograd: a custom op's backward runs below autograd.)"""
    tokens, heads_k, dim = x.shape
    dxn = d_expanded.view(tokens, heads_k, -1, dim).sum(2)
    if not use_qk_l2norm:
        return dxn
    x = x.to(dtype)
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    xn = x * r
    return r * (dxn - xn * (xn * dxn).sum(-1, keepdim=True))


def gated_delta_backward_reference(d_out, d_final, q, k, v, g, beta, scale, initial_state, cu, use_qk_l2norm,
                                   chunk_size):
    """(dq, dk, dv, dg, dbeta, d_initial_state or None) in the inputs' dtypes; d_final may be None."""
    dtype = compute_dtype(q, k, v, initial_state)
    heads_v, dk_dim, dv_dim = v.shape[1], q.shape[-1], v.shape[-1]
    qh, kh = prepare_qk(q, k, heads_v, scale, use_qk_l2norm, dtype)
    grads = {name: torch.zeros(x.shape, dtype=dtype, device=v.device)
             for name, x in (("q", qh), ("k", kh), ("v", v), ("g", g), ("beta", beta))}
    d_init = []
    for n, (bos, eos) in enumerate(_docs(cu)):
        state = (initial_state[n].to(dtype) if initial_state is not None
                 else torch.zeros(heads_v, dk_dim, dv_dim, dtype=dtype, device=v.device))
        saved = []
        for s in range(bos, eos, chunk_size):  # forward again, keeping each chunk's entering state
            e = min(s + chunk_size, eos)
            qc, kc, vc = (_heads_first(x, s, e, dtype) for x in (qh, kh, v))
            bc = _heads_first(beta, s, e, dtype)
            c = _chunk_terms(qc, kc, vc, _heads_first(g, s, e, dtype), bc)
            _, delta, nxt = _chunk_forward(c, qc, kc, state)
            saved.append((s, e, c, qc, kc, vc, bc, state, delta))
            state = nxt
        d_state = (d_final[n].to(dtype) if d_final is not None
                   else torch.zeros(heads_v, dk_dim, dv_dim, dtype=dtype, device=v.device))
        for s, e, c, qc, kc, vc, bc, state, delta in reversed(saved):
            d_out_c = _heads_first(d_out, s, e, dtype)
            parts = _chunk_backward(c, qc, kc, vc, bc, state, delta, d_out_c, d_state)
            for name, part in zip(("q", "k", "v", "g", "beta"), parts[:5]):
                grads[name][s:e] = part.transpose(0, 1)
            d_state = parts[5]
        d_init.append(d_state)
    dq = _qk_backward(q, grads["q"] * scale, use_qk_l2norm, dtype)
    dk = _qk_backward(k, grads["k"], use_qk_l2norm, dtype)
    d_initial = None
    if initial_state is not None:
        d_initial = (torch.stack(d_init) if d_init else torch.zeros_like(initial_state)).to(initial_state.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), grads["v"].to(v.dtype), grads["g"].to(g.dtype),
            grads["beta"].to(beta.dtype), d_initial)
