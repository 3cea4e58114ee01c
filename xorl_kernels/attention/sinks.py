"""Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax.

With scores s_ij (already scaled) and the sink σ_h of the row's head,

    L_i   = log(Σ_j exp(s_ij) + exp(σ_h))           (the lse the kernels return)
    out_i = Σ_j exp(s_ij - L_i) v_j                 (the sink takes probability, gives no value)

so a row that sees no key has out = 0 and lse = σ_h (finite). The gradient of the sink is
    dσ_h = -Σ_i exp(σ_h - L_i) · delta_i,   delta_i = rowsum(dO_i · O_i) - dlse_i,
the same delta the flash-attention backward takes; q, k and v need nothing else (their
P = exp(S - L) already uses the lse with the sink in it).

Ring attention runs its steps without sinks, merges them with ``merge_attn_states``, then applies
the sink once per row with ``apply_sinks`` (the sink counts once per row, not once per step);
its backward passes the final lse to every step and calls ``sink_grad`` once.

Layouts follow ``flash_attn_with_lse``: out [batch, seq, heads, d] with lse [batch, heads, seq], or
out [total, heads, d] with lse [heads, total] (or [1, heads, total]); sinks [heads]. Plain torch:
any device, differentiable.
"""

from __future__ import annotations

import torch


def _check_sinks(sinks: torch.Tensor, lse: torch.Tensor) -> None:
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a 1-D float tensor [heads], got {sinks!r}")
    if lse.dim() < 2 or lse.shape[-2] != sinks.shape[0]:
        raise ValueError(
            f"sinks has {sinks.shape[0]} entries but lse {tuple(lse.shape)} has {lse.shape[-2] if lse.dim() > 1 else '?'} "
            "heads (lse is [..., heads, seq])"
        )


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of an attention without sinks -> the same attention with ``sinks`` in its softmax.

    lse' = logaddexp(lse, sink); out' = out · exp(lse - lse'). lse = -inf (no key) gives out' = 0,
    lse' = sink. out' keeps out's dtype; lse' is lse's dtype (fp32/fp64).
    """
    _check_sinks(sinks, lse)
    if out.dim() != lse.dim() + 1 or out.shape[:-3] != lse.shape[:-2] or out.shape[-3:-1] != lse.shape[:-3:-1]:
        raise ValueError(f"out {tuple(out.shape)} does not match lse {tuple(lse.shape)} ([..., seq, heads, d] / [..., heads, seq])")
    sink = sinks.to(device=lse.device, dtype=lse.dtype)[:, None]  # [heads, 1] broadcasts over [..., heads, seq]
    new_lse = torch.logaddexp(lse, sink)
    scale = torch.exp(lse - new_lse)  # 0 where lse = -inf (never NaN: new_lse is finite)
    scale = scale.transpose(-1, -2).unsqueeze(-1)  # [..., seq, heads, 1]
    return (out * scale).to(out.dtype), new_lse


def sink_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [heads] in sinks' dtype (summed in fp32, fp64 for fp64 inputs).

    ``lse`` is the final lse (sink included), ``delta`` = rowsum(dO·O) - dlse in the same layout:
    exactly what ``flash_attn_backward`` takes. Rows outside this call (other ranks) add their own
    part; the sum over rows is linear.
    """
    _check_sinks(sinks, lse)
    if delta.shape != lse.shape:
        raise ValueError(f"delta {tuple(delta.shape)} must have lse's shape {tuple(lse.shape)}")
    dtype = torch.float64 if torch.float64 in (lse.dtype, delta.dtype, sinks.dtype) else torch.float32
    sink = sinks.to(device=lse.device, dtype=dtype)[:, None]
    prob = torch.exp(sink - lse.to(dtype))  # lse >= sink, so prob is in (0, 1]
    per_row = (prob * delta.to(dtype)).transpose(0, -2)  # heads first
    return (-per_row.reshape(per_row.shape[0], -1).sum(1)).to(sinks.dtype)
