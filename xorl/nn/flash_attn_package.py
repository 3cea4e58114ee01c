"""Optional ring-step kernel on the `flash_attn` pip package (``RingAttention(attn_backend="flash_attn")``).

Never required: imported only when that backend is chosen, with a clear error if the package is
missing. flash-attn has no position-based mask, so each zig-zag step is mapped onto its varlen API
with the ranks known on the host:

- own block (k_rank == q_rank): causal over the local documents (chunk r then chunk 2P-1-r are
  in causal order inside each local document);
- k_rank < q_rank: every query sees exactly the first half (chunk k_rank) of each document's keys;
- k_rank > q_rank: only the second half (chunk 2P-1-q_rank) of each document's queries sees keys,
  and it sees all of them; the first half gets out = 0, lse = -inf.

Halves are gathered with indices computed on the device (a stable argsort, no host sync). The
backward uses the global out / lse (flash-attn recomputes rowsum(dO·O) itself) and adds each
step's gradients into the fp32 accumulators. Signature differences between flash-attn 2.x
releases (window_size tuple vs left/right, return tuples) are bridged by inspection.
"""

from __future__ import annotations

import inspect

import torch


def _interface():
    try:
        from flash_attn import flash_attn_interface
    except ImportError as error:
        raise ImportError(
            "attn_backend='flash_attn' needs the flash-attn package (pip install flash-attn); "
            "use attn_backend='xorl' for the xorl kernels"
        ) from error
    return flash_attn_interface


def _call(fn, **kwargs):
    """Call a flash-attn internal with the keyword names this release understands."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kwargs["window_size"] = (kwargs.pop("window_size_left", -1), kwargs.pop("window_size_right", -1))
    return fn(**{k: v for k, v in kwargs.items() if k in params})


class FlashAttnPackageStepKernel:
    """Same interface as ring_step_kernel.ZigzagStepKernel (forward / backward of one ring step)."""

    def __init__(self, ring_size: int, causal: bool, softmax_scale: float, cu_local, max_local: int,
                 local_len: int):  # fmt: skip
        self.fa = _interface()
        self.ring_size, self.causal, self.scale = ring_size, causal, softmax_scale
        self.cu_local, self.max_local, self.local_len = cu_local, max_local, local_len
        self._halves = None

    # -- layout helpers ------------------------------------------------------------------------
    def _cu(self, batch: int, device) -> torch.Tensor:
        if self.cu_local is not None:
            return self.cu_local.to(device=device, dtype=torch.int32)
        return torch.arange(batch + 1, device=device, dtype=torch.int32) * self.local_len

    def _half_index(self, cu: torch.Tensor, total: int, which: int) -> torch.Tensor:
        """Packed row indices of the first (0) or second (1) half of every local document."""
        if self._halves is None:
            idx = torch.arange(total, device=cu.device)
            doc = torch.searchsorted(cu.long(), idx, right=True) - 1
            start = cu.long()[doc]
            first = (idx - start) < (cu.long()[doc + 1] - start) // 2
            # Stable argsort puts the True rows first in order; exactly total/2 of each (no sync).
            self._halves = (torch.argsort(~first, stable=True)[: total // 2],
                            torch.argsort(first, stable=True)[: total // 2])  # fmt: skip
        return self._halves[which]

    def _plan(self, q_rank: int, k_rank: int):
        """(causal, q half or None, k half or None) for this step."""
        if not self.causal or self.ring_size == 1:
            return self.causal, None, None
        if k_rank == q_rank:
            return True, None, None
        return (False, None, 0) if k_rank < q_rank else (False, 1, None)

    # -- forward / backward --------------------------------------------------------------------
    def has_work(self, q_rank: int, k_rank: int) -> bool:
        return True  # no sliding window on this backend: every zig-zag step sees keys

    def forward(self, q, k, v, q_rank: int, k_rank: int):
        b, s, hq, d = q.shape
        qp, kp, vp = q.reshape(b * s, hq, d), k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:])
        cu = self._cu(b, q.device)
        causal, q_half, k_half = self._plan(q_rank, k_rank)
        cu_q, cu_k, max_q, max_k = cu, cu, self.max_local, self.max_local
        if k_half is not None:
            index = self._half_index(cu, b * s, k_half)
            kp, vp, cu_k, max_k = kp[index], vp[index], cu // 2, self.max_local // 2
        if q_half is not None:
            index = self._half_index(cu, b * s, q_half)
            qp, cu_q, max_q = qp[index], cu // 2, self.max_local // 2
        result = _call(
            self.fa._flash_attn_varlen_forward, q=qp, k=kp, v=vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=self.scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        )  # fmt: skip
        out, lse = (result[0], result[1]) if len(result) == 4 else (result[0], result[5])
        if q_half is not None:
            full_out = out.new_zeros(b * s, hq, out.shape[-1])
            full_lse = lse.new_full((hq, b * s), float("-inf"))
            full_out[index], full_lse[:, index] = out, lse
            out, lse = full_out, full_lse
        return out.view(b, s, hq, -1), lse.view(hq, b, s).transpose(0, 1)

    def backward(self, do, q, k, v, out, lse, delta, q_rank: int, k_rank: int, dq_acc, dk_acc, dv_acc):
        b, s, hq, d = q.shape
        flat = lambda t: t.reshape(b * s, *t.shape[2:])  # noqa: E731
        qp, kp, vp, dop, outp = flat(q), flat(k), flat(v), flat(do), flat(out)
        lsep = lse.transpose(0, 1).reshape(hq, b * s)
        cu = self._cu(b, q.device)
        causal, q_half, k_half = self._plan(q_rank, k_rank)
        cu_q, cu_k, max_q, max_k = cu, cu, self.max_local, self.max_local
        q_index = k_index = None
        if k_half is not None:
            k_index = self._half_index(cu, b * s, k_half)
            kp, vp, cu_k, max_k = kp[k_index], vp[k_index], cu // 2, self.max_local // 2
        if q_half is not None:
            q_index = self._half_index(cu, b * s, q_half)
            qp, dop, outp, lsep = qp[q_index], dop[q_index], outp[q_index], lsep[:, q_index]
            cu_q, max_q = cu // 2, self.max_local // 2
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        _call(
            self.fa._flash_attn_varlen_backward, dout=dop.contiguous(), q=qp.contiguous(), k=kp.contiguous(),
            v=vp.contiguous(), out=outp.contiguous(), softmax_lse=lsep.contiguous(), dq=dq, dk=dk, dv=dv,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0,
            softmax_scale=self.scale, causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None,
        )  # fmt: skip
        for acc, grad, index in ((dq_acc, dq, q_index), (dk_acc, dk, k_index), (dv_acc, dv, k_index)):
            acc_flat = acc.view(b * s, *acc.shape[2:])
            if index is None:
                acc_flat.add_(grad)
            else:
                acc_flat.index_add_(0, index, grad.float())
