"""Plain-torch depthwise causal conv1d with its activation, forward and backward (the CPU path).

Per document (packed rows, [tokens, dim]) the input is prefixed with the W-1 inputs before its
start (``initial_state[n]`` [dim, W-1], or zeros) and convolved channel by channel:

    z[t, d] = bias[d] + sum_i weight[d, i] * x[t - (W-1) + i, d],    y = act(z)

so no document reads another's tokens. Backward (dz = dy * act'(z); silu' = σ(z)(1 + z(1 - σ(z)))):
dweight[d, i] = sum_t dz[t, d] x[t - (W-1) + i, d] (a window product), dx and the initial state's
gradient are the transposed convolution of dz, split at the document start. Explicit formulas, not
autograd: a custom op's backward runs below autograd. Arithmetic in float64 for float64 inputs,
float32 otherwise (transformers runs the conv in the weight's dtype, fp32 in training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _activate(z, activation):
    return F.silu(z) if activation in ("silu", "swish") else z


def _activation_grad(z, activation):
    if activation not in ("silu", "swish"):
        return torch.ones_like(z)
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _docs(cu):
    return [(int(cu[n]), int(cu[n + 1])) for n in range(cu.numel() - 1)]


def _prefixed(x, initial_state, n, bos, eos, width, dtype):
    """[dim, W-1 + L]: the document's W-1 earlier inputs, then its own, channels first."""
    before = (initial_state[n].to(dtype) if initial_state is not None
              else x.new_zeros((x.shape[1], width - 1), dtype=dtype))
    return torch.cat([before, x[bos:eos].to(dtype).t()], 1)


def _pre_activation(xp, weight, bias, dtype):
    dim = xp.shape[0]
    b = bias.to(dtype) if bias is not None else None
    return F.conv1d(xp[None], weight.to(dtype)[:, None, :], b, groups=dim)[0]  # [dim, L]


def causal_conv1d_forward_reference(x, weight, bias, activation, initial_state, cu):
    """y [tokens, dim] in x's dtype; x packed [tokens, dim], weight [dim, W], cu int64 on the host."""
    dtype = _compute_dtype(x)
    width = weight.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for n, (bos, eos) in enumerate(_docs(cu)):
        if eos == bos:
            continue
        z = _pre_activation(_prefixed(x, initial_state, n, bos, eos, width, dtype), weight, bias, dtype)
        y[bos:eos] = _activate(z, activation).t().to(x.dtype)
    return y


def causal_conv1d_backward_reference(dy, x, weight, bias, activation, initial_state, cu):
    """(dx, dweight, dbias or None, d_initial_state or None) in the inputs' dtypes."""
    dtype = _compute_dtype(x)
    dim, width = weight.shape
    dx = torch.empty(x.shape, dtype=dtype, device=x.device)
    dw = torch.zeros(dim, width, dtype=dtype, device=x.device)
    db = torch.zeros(dim, dtype=dtype, device=x.device)
    d_init = []
    for n, (bos, eos) in enumerate(_docs(cu)):
        if eos == bos:  # an empty document: its initial state reaches nothing
            d_init.append(torch.zeros(dim, width - 1, dtype=dtype, device=x.device))
            continue
        xp = _prefixed(x, initial_state, n, bos, eos, width, dtype)
        z = _pre_activation(xp, weight, bias, dtype)
        dz = dy[bos:eos].to(dtype).t() * _activation_grad(z, activation)  # [dim, L]
        dw += torch.einsum("dl,dlw->dw", dz, xp.unfold(1, width, 1))
        db += dz.sum(1)
        dxp = F.conv_transpose1d(dz[None], weight.to(dtype)[:, None, :], groups=dim)[0]  # [dim, W-1 + L]
        dx[bos:eos] = dxp[:, width - 1:].t()
        d_init.append(dxp[:, :width - 1])
    d_initial = None
    if initial_state is not None:
        d_initial = (torch.stack(d_init) if d_init else torch.zeros_like(initial_state)).to(initial_state.dtype)
    return (dx.to(x.dtype), dw.to(weight.dtype), db.to(bias.dtype) if bias is not None else None, d_initial)
