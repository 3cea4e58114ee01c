"""Flash attention's input normalisation: every call becomes one packed form, and results go back.

Every backend works on ``Packed``: q [total_q, heads_q, head_dim_qk], k [total_k, heads_kv,
head_dim_qk], v [total_k, heads_kv, head_dim_v] (head_dim_v may differ, MLA), int32
``cu_seqlens_q`` / ``cu_seqlens_k``, optional int32 positions, sinks and window. ``pack`` checks
the public arguments (layouts in attention/op.py) and builds it; the ``*_to_public`` /
``*_to_packed`` helpers convert outputs, lse and gradients between the public layout and the
packed one. Value checks that would read device memory run only for CPU tensors (a GPU check
would cost a host sync per call, and ring attention calls once per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Packed:
    """One call normalised to the packed form every backend works on (see attention/reference.py)."""

    q: torch.Tensor  # [total_q, heads_q, head_dim_qk]
    k: torch.Tensor  # [total_k, heads_kv, head_dim_qk]
    v: torch.Tensor  # [total_k, heads_kv, head_dim_v]
    cu_seqlens_q: torch.Tensor  # int32 [num_docs + 1]
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    q_positions: torch.Tensor | None  # int [total_q]
    k_positions: torch.Tensor | None
    causal: bool
    softmax_scale: float
    layout: str  # "batched", "packed4d" or "packed3d": how to give results back
    batch: int
    seq_q: int
    sinks: torch.Tensor | None = None  # [heads_q] float logits (see attention/sinks.py)
    window: int | None = None  # causal sliding window W: k_pos > q_pos - W


# -- input normalisation -------------------------------------------------------------------------


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int tensor [num_docs + 1], got {cu!r}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}; cast it with .int()")
    cu = cu.to(device=device, dtype=torch.int32)
    if cu.is_cuda:
        # Value checks would cost a device sync per call (ring attention calls once per step).
        return cu
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {first}..{last}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    return cu


def _check_positions(name: str, pos, total: int, batch: int, per_row: int, device) -> torch.Tensor | None:
    if pos is None:
        return None
    if pos.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {pos.dtype}")
    pos = pos.to(device).reshape(-1)
    if batch > 1 and pos.numel() == per_row:
        pos = pos.repeat(batch)
    if pos.numel() != total:
        raise ValueError(f"{name} must have one entry per token ({total}), got shape {tuple(pos.shape)}")
    # The kernels keep positions in int32 (and use +-(2**31 - 1) as padding sentinels).
    if pos.dtype == torch.int64 and not pos.is_cuda and pos.numel() and int(pos.abs().max()) >= 2**31 - 1:
        raise ValueError(f"{name} must fit in int32 (|pos| < 2**31 - 1)")
    return pos.to(torch.int32)


def pack(
    q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, q_positions, k_positions, sinks=None, window=None,
) -> Packed:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use float16, bfloat16, float32 (or float64)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        raise ValueError(
            "q, k, v must all be [batch, seq, heads, head_dim] (or [total, heads, head_dim] with "
            f"cu_seqlens), got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must match in all but head_dim (which may differ), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads of k/v ({heads_kv}) must divide heads of q ({heads_q}) for GQA/MQA")

    if cu_seqlens is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("pass either cu_seqlens (both sides) or cu_seqlens_q/cu_seqlens_k, not both")
        cu_seqlens_q = cu_seqlens_k = cu_seqlens
        max_seqlen_q = max_seqlen_k = max_seqlen
    elif max_seqlen is not None:
        max_seqlen_q = max_seqlen_q if max_seqlen_q is not None else max_seqlen
        max_seqlen_k = max_seqlen_k if max_seqlen_k is not None else max_seqlen
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (or use cu_seqlens)")

    device = q.device
    if not varlen:
        if q.dim() != 4:
            raise ValueError("3-D q/k/v ([total, heads, head_dim]) need cu_seqlens; batched input is 4-D")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
        batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq_q
        cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq_k
        max_q, max_k, layout = seq_q, seq_k, "batched"
        qp, kp, vp = (t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v))
    else:
        if q.dim() == 4:
            if q.shape[0] != 1 or k.shape[0] != 1:
                raise ValueError(
                    f"with cu_seqlens the batch must be 1 (documents packed along seq), got {q.shape[0]}"
                )
            qp, kp, vp, layout = q[0], k[0], v[0], "packed4d"
        else:
            qp, kp, vp, layout = q, k, v, "packed3d"
        cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, qp.shape[0], device)
        cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, kp.shape[0], device)
        if cu_q.numel() != cu_k.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must list the same documents, got {cu_q.numel() - 1} "
                f"and {cu_k.numel() - 1}"
            )
        batch, seq_q, seq_k = 1, qp.shape[0], kp.shape[0]
        max_q, max_k = max_seqlen_q, max_seqlen_k
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q_pos = _check_positions("q_positions", q_positions, qp.shape[0], batch, seq_q, device)
    k_pos = _check_positions("k_positions", k_positions, kp.shape[0], batch, seq_k, device)
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_positions and k_positions must be given together")
    window = _check_window(window, causal)
    if window is not None:
        _check_ascending("q_positions", q_pos, cu_q)
        _check_ascending("k_positions", k_pos, cu_k)
    return Packed(
        qp, kp, vp, cu_q, cu_k, max_q, max_k, q_pos, k_pos, bool(causal), float(softmax_scale),
        layout, batch, seq_q, _check_sinks(sinks, heads_q, device), window,
    )


def _check_ascending(name: str, pos: torch.Tensor | None, cu: torch.Tensor) -> None:
    """With a window the Triton kernels find their bounds by searching the positions, so positions
    must not decrease inside a document (zig-zag shards and gathered sequences ascend). Checked
    for CPU tensors only (a GPU check would sync the device every call)."""
    if pos is None or pos.is_cuda or pos.numel() < 2:
        return
    drops = ((pos[1:] < pos[:-1]).nonzero().flatten() + 1).tolist()  # i with pos[i] < pos[i - 1]
    if drops and not set(drops) <= set(cu.tolist()):
        raise ValueError(f"with window, {name} must be non-decreasing inside each document")


def _check_sinks(sinks, heads_q: int, device) -> torch.Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must be a float tensor [heads_q] = [{heads_q}], got {sinks!r}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device {device}, got {sinks.device}")
    return sinks.contiguous()


def _check_window(window, causal: bool) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (the last W positions a query attends) or None, got {window!r}")
    if not causal:
        # A non-causal window has two conventions (transformers' bidirectional overlay is
        # |q - k| <= W, inclusive); no model we train needs one, so it is refused rather than guessed.
        raise ValueError("window (sliding-window attention) needs causal=True; non-causal windows are not supported")
    return int(window)


def out_to_public(out: torch.Tensor, p: Packed) -> torch.Tensor:
    if p.layout == "batched":
        return out.view(p.batch, p.seq_q, *out.shape[1:])
    return out.unsqueeze(0) if p.layout == "packed4d" else out


def lse_to_public(lse: torch.Tensor, p: Packed) -> torch.Tensor:
    """[heads, total_q] -> [batch, heads, seq_q] / [1, heads, total_q] / [heads, total_q]."""
    if p.layout == "batched":
        return lse.view(lse.shape[0], p.batch, p.seq_q).transpose(0, 1).contiguous()
    return lse.unsqueeze(0) if p.layout == "packed4d" else lse


def lse_to_packed(name: str, lse: torch.Tensor, p: Packed) -> torch.Tensor:
    heads = p.q.shape[1]
    expected = {"batched": (p.batch, heads, p.seq_q), "packed4d": (1, heads, p.seq_q)}.get(
        p.layout, (heads, p.seq_q)
    )
    if tuple(lse.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for this layout, got {tuple(lse.shape)}")
    if p.layout == "batched":
        return lse.transpose(0, 1).reshape(heads, -1)
    return lse[0] if p.layout == "packed4d" else lse


def grad_to_packed(name: str, t: torch.Tensor | None, like: torch.Tensor, packed_like: torch.Tensor):
    if t is None:
        return None
    if t.shape != like.shape or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 tensor of shape {tuple(like.shape)}, "
            f"got {t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})"
        )
    return t.view(packed_like.shape)



def out_to_packed(t: torch.Tensor, p: Packed) -> torch.Tensor:
    if p.layout == "batched":
        return t.reshape(-1, *t.shape[2:])
    return t[0] if p.layout == "packed4d" else t
