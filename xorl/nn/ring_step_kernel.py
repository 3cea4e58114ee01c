"""The attention of one zig-zag ring step, for ``RingAttention`` (xorl/nn/ring_attention.py).

``make_step_kernel`` builds it once per call: the ring-local document boundaries, the true
within-document positions of every ring rank's zig-zag chunks (xorl_kernels/zigzag/layout.py), and
under a sliding window the table of steps that can see no key (skipped, known from the layout
alone). ``ZigzagStepKernel`` runs one step's forward / backward on xorl_kernels' flash-attention
pieces; the flash-attn package's counterpart is xorl/nn/flash_attn_package.py.
"""

from __future__ import annotations

import torch

from xorl.nn.attention_backends import FLASH_ATTN
from xorl_kernels.zigzag.layout import zigzag_positions, zigzag_step_in_window


class ZigzagStepKernel:
    """One ring step's attention on the xorl_kernels flash-attention pieces.

    ``q_rank`` / ``k_rank``: which ring rank's zig-zag chunks the q and k blocks are; the kernel
    gets their true within-document positions, precomputed on the device for every rank, and the
    sliding ``window`` (None: none), which it applies to those positions.
    """

    def __init__(
        self,
        ring_size: int,
        causal: bool,
        softmax_scale: float,
        cu_local,
        max_local,
        positions,
        backend: str | None,
        window: int | None = None,
    ):
        self.ring_size, self.causal, self.scale = ring_size, causal, softmax_scale
        self.cu_local, self.max_local, self.positions, self.backend = cu_local, max_local, positions, backend
        self.window = window
        self.active = None  # [q_rank][k_rank] -> bool, set by make_step_kernel when a window allows

    def _mask_kwargs(self, q_rank: int, k_rank: int) -> dict:
        kwargs = dict(causal=self.causal, softmax_scale=self.scale, backend=self.backend)
        if self.window is not None:
            kwargs.update(window=self.window)
        if self.cu_local is not None:
            kwargs.update(cu_seqlens=self.cu_local, max_seqlen=self.max_local)
        if self.positions is not None:
            kwargs.update(q_positions=self.positions[q_rank], k_positions=self.positions[k_rank])
        return kwargs

    def has_work(self, q_rank: int, k_rank: int) -> bool:
        """False when the step is known, from the layout alone, to see no key (its compute is skipped)."""
        return self.active is None or self.active[q_rank][k_rank]

    def forward(self, q, k, v, q_rank: int, k_rank: int):
        from xorl_kernels.attention.op import flash_attn_forward

        return flash_attn_forward(q, k, v, **self._mask_kwargs(q_rank, k_rank))

    def backward(self, do, q, k, v, out, lse, delta, q_rank: int, k_rank: int, dq_acc, dk_acc, dv_acc):
        from xorl_kernels.attention.op import flash_attn_backward

        flash_attn_backward(
            do,
            q,
            k,
            v,
            out,
            lse,
            delta,
            dq_accum=dq_acc,
            dk_accum=dk_acc,
            dv_accum=dv_acc,
            **self._mask_kwargs(q_rank, k_rank),
        )

def _local_boundaries(cu_seqlens, ring_size: int, local_len: int, device):
    """Ring-local document boundaries (global / P) as an int32 device tensor."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1], got {cu.dtype} {tuple(cu.shape)}"
        )
    if cu.device.type == "cpu":  # host data: validating costs no device sync
        lengths = cu[1:] - cu[:-1]
        bad = (
            (lengths % (2 * ring_size) != 0) if ring_size > 1 else torch.zeros_like(lengths, dtype=torch.bool)
        )
        if int(cu[-1]) != local_len * ring_size or bool(bad.any()):
            raise ValueError(
                f"cu_seqlens (GLOBAL boundaries, total {int(cu[-1])}) must end at s_local × ring = "
                f"{local_len * ring_size} and every document must divide by 2 × ring = {2 * ring_size}; "
                "pad with xorl.distributed.zigzag.prepare_context_parallel_batch"
            )
    return torch.div(cu.to(device), ring_size, rounding_mode="floor").to(torch.int32)


def _active_steps(cu_seqlens, ring_size: int, local_len: int, window: int | None):
    """[q_rank][k_rank] -> whether the step can see any key, from the layout alone; None: all can.

    Known without a device read when there is no ``cu_seqlens`` (one document per row) or it is on
    the host (the data loader builds it there); a GPU ``cu_seqlens`` is not read (the kernel then
    visits zero tiles of a step outside the window instead).
    """
    if window is None or ring_size == 1:
        return None
    if cu_seqlens is None:
        chunk = local_len // 2
    elif cu_seqlens.device.type == "cpu":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        lengths = lengths[lengths > 0]
        if lengths.numel() == 0:
            return None
        chunk = int(lengths.min()) // (2 * ring_size)
    else:
        return None
    return [
        [zigzag_step_in_window(q_rank, k_rank, ring_size, chunk, window) for k_rank in range(ring_size)]
        for q_rank in range(ring_size)
    ]


def make_step_kernel(q, cu_seqlens, max_seqlen, ring_size: int, causal: bool, softmax_scale, backend,
                     window: int | None = None):  # fmt: skip
    """The per-step kernel for this call: boundaries and zig-zag positions of every ring rank."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    local_len = q.shape[1]
    cu_local = None if cu_seqlens is None else _local_boundaries(cu_seqlens, ring_size, local_len, q.device)
    max_local = local_len if max_seqlen is None else int(max_seqlen) // ring_size
    positions = None
    if causal and ring_size > 1:
        cu_global = None if cu_local is None else cu_local * ring_size
        positions = zigzag_positions(
            local_len * ring_size, None, ring_size, cu_global, q.device, within_document=True
        ).view(ring_size, local_len)
    if backend == FLASH_ATTN:
        from xorl.nn.flash_attn_package import FlashAttnPackageStepKernel

        return FlashAttnPackageStepKernel(ring_size, causal, scale, cu_local, max_local, local_len)
    # "xorl": xorl_kernels picks its op backend (backend=None: its dispatch).
    kernel = ZigzagStepKernel(ring_size, causal, scale, cu_local, max_local, positions, None, window)
    kernel.active = _active_steps(cu_seqlens, ring_size, local_len, window)
    return kernel
