"""Zig-zag ring attention: a drop-in core attention whose K/V blocks travel around the ring group.

    attn = RingAttention(ring_group)
    out = attn(q, k, v, cu_seqlens=None, max_seqlen=None)   # q [b, s_local, hq, d], k/v [b, s_local, hkv, d]

Layout (xorl.distributed.zigzag): each document is cut into 2P chunks and ring rank r holds chunks
r and 2P-1-r. ``cu_seqlens`` are the GLOBAL document boundaries of the unsharded packed sequence,
identical on every rank (int tensor, batch must then be 1); every document length must divide by
2P — ``prepare_context_parallel_batch`` pads them. ``max_seqlen`` is the global longest document.
Without ``cu_seqlens`` every batch row is one zig-zag sharded sequence.

Forward, step i = 0..P-1: rank r holds the K/V block of rank (r - i) mod P, sends it to r+1 and
receives the next one into the other half of a preallocated double buffer (side stream on GPU)
while ONE attention launch computes this step with the true positions of its q chunks and of the
received k chunks (a query sees a key iff same document and k_pos <= q_pos). Zig-zag makes every
step cost every rank the same. Partial results are folded in with merge_attn_states (fp32).

Backward is a true ring: delta = rowsum(dO·O) once; K/V rotate again; each block's dK/dV
accumulator (fp32 by default, ``dkv_comm_dtype=torch.bfloat16`` halves its bytes) travels one hop
behind its block and arrives home after the last step, while dQ accumulates locally in fp32.
Nothing all-gathers K/V. Bytes each rank sends: forward (P-1)·|K+V|, backward (P-1)·|K+V| +
(P-1)·|dK+dV| (the owner keeps its own contribution instead of shipping it around the ring).
GQA rotates only the KV heads. No host synchronisation in either direction (given max_seqlen).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xorl._torch_compat import resolve_process_group
from xorl.distributed.p2p import RingExchange
from xorl.nn.attention_backends import FLASH_ATTN, RING_STEP_KERNELS, XORL
from xorl_kernels.checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES
from xorl_kernels.zigzag.layout import zigzag_positions

_KV_TAG, _DKV_TAG = 0, 1


class ZigzagStepKernel:
    """One ring step's attention on the xorl_kernels flash-attention pieces.

    ``q_rank`` / ``k_rank``: which ring rank's zig-zag chunks the q and k blocks are; the kernel
    gets their true within-document positions, precomputed on the device for every rank.
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
    ):
        self.ring_size, self.causal, self.scale = ring_size, causal, softmax_scale
        self.cu_local, self.max_local, self.positions, self.backend = cu_local, max_local, positions, backend

    def _mask_kwargs(self, q_rank: int, k_rank: int) -> dict:
        kwargs = dict(causal=self.causal, softmax_scale=self.scale, backend=self.backend)
        if self.cu_local is not None:
            kwargs.update(cu_seqlens=self.cu_local, max_seqlen=self.max_local)
        if self.positions is not None:
            kwargs.update(q_positions=self.positions[q_rank], k_positions=self.positions[k_rank])
        return kwargs

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


def _merge(out_acc, lse_acc, out, lse):
    from xorl_kernels.attention.merge import merge_attn_states

    if out_acc is None:
        return out.to(torch.promote_types(out.dtype, torch.float32)), lse
    return merge_attn_states(out_acc, lse_acc, out, lse)


def ring_forward(q, k, v, kernel, exchange: RingExchange | None):
    """(out in q.dtype, lse fp32) of zig-zag ring attention; no autograd."""
    size = exchange.size if exchange is not None else 1
    rank = exchange.rank if exchange is not None else 0
    if size > 1:
        kv = torch.empty((2, 2, *k.shape), dtype=k.dtype, device=k.device)  # [buffer, k|v, ...]
        kv[0, 0].copy_(k)
        kv[0, 1].copy_(v)
    out_acc = lse_acc = None
    for step in range(size):
        k_cur, v_cur = (kv[step % 2, 0], kv[step % 2, 1]) if size > 1 else (k, v)
        pending = exchange.start(kv[step % 2], kv[(step + 1) % 2], _KV_TAG) if step + 1 < size else None
        out, lse = kernel.forward(q, k_cur, v_cur, rank, (rank - step) % size)
        out_acc, lse_acc = _merge(out_acc, lse_acc, out, lse)
        if pending is not None:
            pending.wait()
    return out_acc.to(q.dtype), lse_acc


def ring_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    kernel,
    exchange: RingExchange | None,
    dkv_comm_dtype: torch.dtype = torch.float32,
):
    """(dq, dk, dv) of zig-zag ring attention, in the dtypes of q, k, v."""
    from xorl_kernels.attention.op import flash_attn_bwd_preprocess

    size = exchange.size if exchange is not None else 1
    rank = exchange.rank if exchange is not None else 0
    delta = flash_attn_bwd_preprocess(out, dout).float()
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_own = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this rank's block
    if size > 1:
        kv = torch.empty((2, 2, *k.shape), dtype=k.dtype, device=k.device)
        kv[0, 0].copy_(k)
        kv[0, 1].copy_(v)
        dkv_work = torch.empty((2, 2, *k.shape), dtype=torch.float32, device=k.device)  # double buffer
        dkv_recv = torch.empty((2, *k.shape), dtype=dkv_comm_dtype, device=k.device)
        dkv_send = (
            None if dkv_comm_dtype == torch.float32 else torch.empty_like(dkv_work, dtype=dkv_comm_dtype)
        )
    dkv_pending = None
    for step in range(size):
        k_cur, v_cur = (kv[step % 2, 0], kv[step % 2, 1]) if size > 1 else (k, v)
        kv_pending = exchange.start(kv[step % 2], kv[(step + 1) % 2], _KV_TAG) if step + 1 < size else None
        target = dkv_own if step == 0 else dkv_work[step % 2].zero_()
        kernel.backward(
            dout, q, k_cur, v_cur, out, lse, delta, rank, (rank - step) % size, dq_acc, target[0], target[1]
        )
        if step >= 1:
            # The accumulator of this block from the ranks before us arrives while we computed.
            if dkv_pending is not None:
                dkv_pending.wait()
                target.add_(dkv_recv)
            send = target if dkv_send is None else dkv_send[step % 2].copy_(target)
            dkv_pending = exchange.start(send, dkv_recv, _DKV_TAG)
        if kv_pending is not None:
            kv_pending.wait()
    if dkv_pending is not None:
        dkv_pending.wait()
        dkv_own.add_(dkv_recv)  # our block's gradient from every other rank, back home
    return dq_acc.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype)


# -- the xorl::ring_attention custom op ----------------------------------------------------------
# Why a torch.library custom op: the ring's point-to-point exchange (and the host-side checks of
# cu_seqlens) cannot be traced by torch.compile; as one opaque op with a fake implementation and a
# registered backward, a compiled decoder block keeps ring attention inside its graph. The process
# group travels by name (custom ops take no Python objects).


def _ring_call(q, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, attn_backend):
    """(step kernel, exchange) of one call, rebuilt in the forward and in the backward op."""
    group = resolve_process_group(group_name) if group_name else None
    size = 1 if group is None else dist.get_world_size(group)
    kernel = make_step_kernel(q, cu_seqlens, max_seqlen, size, causal, softmax_scale, attn_backend)
    return kernel, (RingExchange(group) if size > 1 else None)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::ring_attention")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
    group_name: str, causal: bool, softmax_scale: float | None, dkv_comm_dtype: torch.dtype,
    attn_backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [b, hq, s] fp32) of zig-zag ring attention over the group named ``group_name``."""
    kernel, exchange = _ring_call(q, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, attn_backend)
    out, lse = ring_forward(q, k, v, kernel, exchange)
    # Contiguous, as the fake promises: the merged out may come back with permuted strides.
    return out.contiguous(), lse.contiguous()


@_ring_attention_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, dkv_comm_dtype, attn_backend):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype)


@torch.library.custom_op("xorl::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None, max_seqlen: int | None, group_name: str, causal: bool,
    softmax_scale: float | None, dkv_comm_dtype: torch.dtype, attn_backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel, exchange = _ring_call(q, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, attn_backend)
    dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, kernel, exchange, dkv_comm_dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # fp32 dk and dv are halves of one buffer; an op's outputs must not alias
    return dq, dk, dv


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, *options = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.options = options


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    grads = torch.ops.xorl.ring_attention_backward(dout, q, k, v, out, lse, cu_seqlens, *ctx.options)
    return (*grads, *([None] * 7))


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(q, k, v, cu_seqlens) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"q must be [b, s, hq, d] and k, v [b, s, hkv, d]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same batch, seq and head_dim, "
            "and kv heads dividing q heads"
        )
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(
            f"with cu_seqlens the documents are packed in one row: batch must be 1, got {q.shape[0]}"
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


def make_step_kernel(q, cu_seqlens, max_seqlen, ring_size: int, causal: bool, softmax_scale, backend):
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
    return ZigzagStepKernel(ring_size, causal, scale, cu_local, max_local, positions, None)


class RingAttention(nn.Module):
    """Zig-zag ring attention over ``ring_group`` (None or a 1-rank group = plain local attention).

    ``attn_backend`` (the names of xorl/nn/attention_backends.py): "xorl" (xorl_kernels.flash_attn,
    which picks Triton on GPU, its reference on CPU) or "flash_attn" (the flash-attn pip package,
    when it imports). ``causal=False`` gives full attention within each document.
    """

    def __init__(
        self,
        ring_group=None,
        causal: bool = True,
        softmax_scale: float | None = None,
        dkv_comm_dtype: torch.dtype = torch.float32,
        attn_backend: str = XORL,
    ):
        super().__init__()
        if dkv_comm_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dkv_comm_dtype must be float32, bfloat16 or float16, got {dkv_comm_dtype}")
        if attn_backend not in RING_STEP_KERNELS:
            raise ValueError(f"attn_backend={attn_backend!r}: use one of {list(RING_STEP_KERNELS)}")
        self.ring_group = ring_group
        # The custom op finds the group by name; no group (or a 1-rank one) is local attention.
        self._group_name = "" if ring_group is None or dist.get_world_size(ring_group) == 1 else ring_group.group_name
        self.causal = causal
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)
        self.dkv_comm_dtype, self.attn_backend = dkv_comm_dtype, attn_backend

    @property
    def ring_size(self) -> int:
        return 1 if self.ring_group is None else dist.get_world_size(self.ring_group)

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        _check_inputs(q, k, v, cu_seqlens)
        if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = torch.tensor(cu_seqlens)
        if max_seqlen is not None and not isinstance(max_seqlen, (int, torch.SymInt)):
            max_seqlen = int(max_seqlen)
        out, _ = torch.ops.xorl.ring_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, max_seqlen, self._group_name,
            self.causal, self.softmax_scale, self.dkv_comm_dtype, self.attn_backend,
        )
        return out

    def extra_repr(self) -> str:
        return f"ring_size={self.ring_size}, causal={self.causal}, backend={self.attn_backend}"
