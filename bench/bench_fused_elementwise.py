"""Fused RMSNorm (+ residual), RoPE and SwiGLU (xorl_kernels) vs the eager op chains and vs
torch.compile of the same chains: forward + backward time (ratio < 1: the fused op is faster), and
as peak fraction the fused op's bandwidth over the device's copy bandwidth (the goal: >= 0.85).

GPU only (on the CPU the kernels run under the Triton interpreter, whose time means nothing): the
CPU run returns no rows. Bytes per call count each tensor read or written once (forward + backward),
the minimum any implementation must move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.context import BenchContext, Result


def _eager_add_rms(x, r, w, eps=1e-6):
    h = x + r
    h32 = h.float()
    return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


def _eager_rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos.unsqueeze(2) + torch.cat((-x2, x1), -1) * sin.unsqueeze(2)


def _eager_swiglu(g, u):
    return F.silu(g) * u


def _cases(ctx: BenchContext):
    from xorl_kernels.activation.op import swiglu
    from xorl_kernels.rmsnorm.op import rms_norm
    from xorl_kernels.rope.op import apply_rotary

    dev, dt = ctx.device, torch.bfloat16
    tokens, hidden = (4096, 4096) if ctx.quick else (16384, 8192)
    heads, head_dim, inter = 32, 128, 14336 if not ctx.quick else 4096
    el = 2  # bytes per bf16 element
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    r, w = torch.randn_like(x), torch.ones(hidden, device=dev, dtype=dt)
    q = torch.randn(1, tokens, heads, head_dim, device=dev, dtype=dt)
    ang = torch.randn(1, tokens, head_dim // 2, device=dev)
    cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    g, u = torch.randn(tokens, inter, device=dev, dtype=dt), torch.randn(tokens, inter, device=dev, dtype=dt)
    n = x.numel() * el
    return [
        # fwd: read x, r; write y, h. bwd: read dy, dh, h; write dx.
        ("add+rmsnorm", lambda a, b, c: rms_norm(a, c, 1e-6, b), _eager_add_rms, (x, r, w), 8 * n),
        # fwd: read x, write y; bwd: read dy, write dx (cos / sin are small).
        ("rope", apply_rotary, _eager_rope, (q, cos, sin), 4 * q.numel() * el),
        # fwd: read g, u, write y; bwd: read dy, g, u, write dg, du.
        ("swiglu", swiglu, _eager_swiglu, (g, u), 8 * g.numel() * el),
    ]


def _fwd_bwd(fn, inputs, grad_args: int):
    leaves = [t.detach().requires_grad_(i < grad_args) for i, t in enumerate(inputs)]

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return step


def run(ctx: BenchContext) -> list[Result]:
    if not ctx.on_gpu:
        return []
    results = []
    for name, fused, eager, inputs, nbytes in _cases(ctx):
        grad_args = 1 if name == "rope" else len(inputs)
        t_fused = ctx.time(_fwd_bwd(fused, inputs, grad_args))
        t_eager = ctx.time(_fwd_bwd(eager, inputs, grad_args))
        t_compiled = ctx.time(_fwd_bwd(torch.compile(eager), inputs, grad_args))
        gbps = nbytes / t_fused / 1e9
        params = {"shapes": [tuple(t.shape) for t in inputs], "dtype": "bfloat16", "bytes": nbytes}
        frac = gbps / ctx.peaks["copy_gbps"] if ctx.peaks.get("copy_gbps") else None
        results += [
            Result(name=f"{name} fwd+bwd vs eager", value=t_fused * 1e3, unit="ms", anchor="eager op chain",
                   anchor_value=t_eager * 1e3, higher_is_better=False, peak_fraction=frac, params=params),
            Result(name=f"{name} fwd+bwd vs torch.compile", value=t_fused * 1e3, unit="ms",
                   anchor="torch.compile of the eager chain", anchor_value=t_compiled * 1e3, higher_is_better=False,
                   peak_fraction=frac, params=params),
        ]
    return results
