"""Zig-zag ring attention: a drop-in core attention whose K/V blocks travel around the ring group.

    attn = RingAttention(ring_group)
    out = attn(q, k, v, cu_seqlens=None, max_seqlen=None, sinks=None, window=None)
    # q [b, s_local, hq, d_qk], k [b, s_local, hkv, d_qk], v [b, s_local, hkv, d_v] -> [b, s_local, hq, d_v]

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

MLA (d_v != d_qk): K and V travel in one flat buffer per hop, each with its own width.
Sinks [hq] (gpt-oss): the steps run without them; the merged (out, lse) takes them once per row
(``apply_sinks``), so the lse every backward step uses includes the sink, and dsinks is computed
once from the final lse and delta (``sink_grad``) for this rank's query rows; the sum over the CP
ranks is the usual reduction of a replicated parameter's gradient (FSDP over dp_shard_cp).
Sliding window W: every step passes W with the true positions, so the kernel never reads a tile
outside the band; a step whose key chunks lie wholly outside every local query's window (known
from the zig-zag layout and the shortest document, when cu_seqlens is on the host or absent) is
not launched at all. At S = 4096, W = 128, P = 4 the ring visits exactly the tiles of one
monolithic windowed attention (tests/unit/kernels/test_ring_tiles.py).

The attention of one ring step (positions, boundaries, the steps a window skips) is built by
xorl/nn/ring_step_kernel.py; this file holds the ring itself, its custom op and the module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xorl._torch_compat import resolve_process_group
from xorl.distributed.p2p import RingExchange
from xorl.nn.attention_backends import FLASH_ATTN, RING_STEP_KERNELS, XORL
from xorl.nn.ring_step_kernel import make_step_kernel
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES

_KV_TAG, _DKV_TAG = 0, 1


def _merge(out_acc, lse_acc, out, lse):
    from xorl_kernels.attention.merge import merge_attn_states

    if out_acc is None:
        return out.to(torch.promote_types(out.dtype, torch.float32)), lse
    return merge_attn_states(out_acc, lse_acc, out, lse)


class _PairBuffers:
    """``slots`` flat buffers, each holding an ``a``-shaped then a ``b``-shaped tensor.

    Why flat: one ring hop is one message, and K and V (or dK and dV) differ in width when
    head_dim_v != head_dim_qk (MLA), so they cannot share a stacked [2, ...] buffer.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, slots: int, dtype: torch.dtype | None = None):
        self.na = a.numel()
        self.flat = torch.empty((slots, self.na + b.numel()), dtype=dtype or a.dtype, device=a.device)
        self.shapes = (a.shape, b.shape)

    def pair(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.flat[slot]
        return row[: self.na].view(self.shapes[0]), row[self.na :].view(self.shapes[1])


def ring_forward(q, k, v, kernel, exchange: RingExchange | None, sinks=None):
    """(out in q.dtype, lse fp32) of zig-zag ring attention; no autograd.

    ``sinks`` [heads_q]: every step runs without them; the merged (out, lse) takes them once per
    row at the end, so the returned lse includes the sink (what the backward needs).
    """
    size = exchange.size if exchange is not None else 1
    rank = exchange.rank if exchange is not None else 0
    if size > 1:
        kv = _PairBuffers(k, v, 2)
        k0, v0 = kv.pair(0)
        k0.copy_(k)
        v0.copy_(v)
    out_acc = lse_acc = None
    for step in range(size):
        k_cur, v_cur = kv.pair(step % 2) if size > 1 else (k, v)
        pending = exchange.start(kv.flat[step % 2], kv.flat[(step + 1) % 2], _KV_TAG) if step + 1 < size else None
        k_rank = (rank - step) % size
        if kernel.has_work(rank, k_rank):
            out, lse = kernel.forward(q, k_cur, v_cur, rank, k_rank)
            out_acc, lse_acc = _merge(out_acc, lse_acc, out, lse)
        if pending is not None:
            pending.wait()
    if sinks is not None:
        from xorl_kernels.attention.sinks import apply_sinks

        out_acc, lse_acc = apply_sinks(out_acc, lse_acc, sinks)
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
    sinks=None,
):
    """(dq, dk, dv, dsinks) of zig-zag ring attention, in the dtypes of q, k, v, sinks.

    ``out`` / ``lse`` are the final ones (lse including the sinks): every step's P = exp(S - lse)
    is then already normalised over the sinks, and delta = rowsum(dO·O) is the final one.
    ``dsinks`` (None without sinks) covers this rank's query rows only: the sinks are replicated
    parameters, summed over the CP ranks with every other replicated gradient (FSDP over
    dp_shard_cp, or the DDP all-reduce).
    """
    from xorl_kernels.attention.op import flash_attn_bwd_preprocess

    size = exchange.size if exchange is not None else 1
    rank = exchange.rank if exchange is not None else 0
    delta = flash_attn_bwd_preprocess(out, dout).float()
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_own = _PairBuffers(k, v, 1, torch.float32)  # this rank's block
    dkv_own.flat.zero_()
    if size > 1:
        kv = _PairBuffers(k, v, 2)
        k0, v0 = kv.pair(0)
        k0.copy_(k)
        v0.copy_(v)
        dkv_work = _PairBuffers(k, v, 2, torch.float32)  # double buffer
        dkv_recv = _PairBuffers(k, v, 1, dkv_comm_dtype).flat[0]
        dkv_send = None if dkv_comm_dtype == torch.float32 else _PairBuffers(k, v, 2, dkv_comm_dtype).flat
    dkv_pending = None
    for step in range(size):
        k_cur, v_cur = kv.pair(step % 2) if size > 1 else (k, v)
        kv_pending = exchange.start(kv.flat[step % 2], kv.flat[(step + 1) % 2], _KV_TAG) if step + 1 < size else None
        if step == 0:
            target, (dk_target, dv_target) = dkv_own.flat[0], dkv_own.pair(0)
        else:
            target, (dk_target, dv_target) = dkv_work.flat[step % 2].zero_(), dkv_work.pair(step % 2)
        k_rank = (rank - step) % size
        if kernel.has_work(rank, k_rank):
            kernel.backward(dout, q, k_cur, v_cur, out, lse, delta, rank, k_rank, dq_acc, dk_target, dv_target)
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
        dkv_own.flat[0].add_(dkv_recv)  # our block's gradient from every other rank, back home
    dk, dv = dkv_own.pair(0)
    dsinks = None
    if sinks is not None:
        from xorl_kernels.attention.sinks import sink_grad

        dsinks = sink_grad(lse, delta, sinks).to(sinks.dtype)
    return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


# -- the xorl::ring_attention custom op ----------------------------------------------------------
# Why a torch.library custom op: the ring's point-to-point exchange (and the host-side checks of
# cu_seqlens) cannot be traced by torch.compile; as one opaque op with a fake implementation and a
# registered backward, a compiled decoder block keeps ring attention inside its graph. The process
# group travels by name (custom ops take no Python objects).


def _ring_call(q, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, attn_backend, window):
    """(step kernel, exchange) of one call, rebuilt in the forward and in the backward op."""
    group = resolve_process_group(group_name) if group_name else None
    size = 1 if group is None else dist.get_world_size(group)
    kernel = make_step_kernel(q, cu_seqlens, max_seqlen, size, causal, softmax_scale, attn_backend, window)
    return kernel, (RingExchange(group) if size > 1 else None)


SELECTIVE_CHECKPOINT_SAVES.join("xorl::ring_attention")  # its output is kept, not recomputed


@torch.library.custom_op("xorl::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None, group_name: str, causal: bool, softmax_scale: float | None,
    dkv_comm_dtype: torch.dtype, attn_backend: str | None, window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [b, hq, s] fp32) of zig-zag ring attention over the group named ``group_name``."""
    kernel, exchange = _ring_call(q, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, attn_backend, window)
    out, lse = ring_forward(q, k, v, kernel, exchange, sinks)
    # Contiguous, as the fake promises: the merged out may come back with permuted strides.
    return out.contiguous(), lse.contiguous()


@_ring_attention_op.register_fake
def _(q, k, v, sinks, *args):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty(out_shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype)


@torch.library.custom_op("xorl::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
    group_name: str, causal: bool, softmax_scale: float | None, dkv_comm_dtype: torch.dtype,
    attn_backend: str | None, window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is an empty tensor when there are no sinks."""
    kernel, exchange = _ring_call(q, cu_seqlens, max_seqlen, group_name, causal, softmax_scale, attn_backend, window)
    dq, dk, dv, dsinks = ring_backward(
        dout.contiguous(), q, k, v, out, lse, kernel, exchange, dkv_comm_dtype, sinks
    )
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # fp32 dk and dv are halves of one buffer; an op's outputs must not alias
    return dq, dk, dv, (q.new_empty(0) if dsinks is None else dsinks)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, sinks, *args):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, *options = inputs
    ctx.save_for_backward(q, k, v, sinks, *output, cu_seqlens)
    ctx.options = options


def _backward(ctx, dout, _dlse):
    q, k, v, sinks, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.xorl.ring_attention_backward(
        dout, q, k, v, sinks, out, lse, cu_seqlens, *ctx.options
    )
    return dq, dk, dv, (None if sinks is None else dsinks), *([None] * 8)


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(q, k, v, cu_seqlens, sinks=None, window=None, causal=True) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q must be [b, s, hq, d_qk], k [b, s, hkv, d_qk] and v [b, s, hkv, d_v]; got {tuple(q.shape)}, "
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
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(
            f"sinks must be [heads_q] = [{q.shape[2]}] (this rank's query heads), got {tuple(sinks.shape)}"
        )
    if window is not None and (not causal or window < 1):
        raise ValueError(
            f"window={window}: a sliding window is a causal mask of at least 1 key (the query itself); "
            "use causal=True and window >= 1, or window=None"
        )

class RingAttention(nn.Module):
    """Zig-zag ring attention over ``ring_group`` (None or a 1-rank group = plain local attention).

    ``attn_backend`` (the names of xorl/nn/attention_backends.py): "xorl" (xorl_kernels.flash_attn,
    which picks Triton on GPU, torch's CPU flash kernel on CPU) or "flash_attn" (the flash-attn pip package,
    when it imports). ``causal=False`` gives full attention within each document.

    Per call (they differ per layer, so they are forward arguments, not module state): ``sinks``
    [heads_q] (gpt-oss: a learned logit per head in every row's softmax denominator; the layer
    owns the parameter) and ``window`` (causal sliding window: a query at position p sees keys
    p - window < k <= p of its document). v may be narrower or wider than q/k (MLA).
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

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None, sinks=None, window=None):
        _check_inputs(q, k, v, cu_seqlens, sinks, window, self.causal)
        if self.attn_backend == FLASH_ATTN and (sinks is not None or window is not None):
            raise ValueError(
                "attn_backend='flash_attn' (the flash-attn package) is not wired for attention sinks or "
                "sliding windows; use attn_backend='xorl' (attn_implementation: xorl)"
            )
        if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = torch.tensor(cu_seqlens)
        if max_seqlen is not None and not isinstance(max_seqlen, (int, torch.SymInt)):
            max_seqlen = int(max_seqlen)
        out, _ = torch.ops.xorl.ring_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), sinks, cu_seqlens, max_seqlen, self._group_name,
            self.causal, self.softmax_scale, self.dkv_comm_dtype, self.attn_backend,
            None if window is None else int(window),
        )
        return out

    def extra_repr(self) -> str:
        return f"ring_size={self.ring_size}, causal={self.causal}, backend={self.attn_backend}"
