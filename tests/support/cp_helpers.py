"""Shared pieces of the context-parallel tests: float64 reference attention, CP groups, error sums,
and counters of the bytes each rank sends (wrapping torch.distributed, not our comm helper)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from xorl.distributed.zigzag import prepare_context_parallel_batch, zigzag_shard


def reference_attention(q, k, v, cu_seqlens=None, causal=True, scale=None, sinks=None, window=None):
    """Float64 plain-torch attention on the FULL sequence: q [b, T, hq, d], k [b, T, hkv, d],
    v [b, T, hkv, d_v]; ``sinks`` [hq]: an extra logit per head in every row's softmax (no value);
    ``window``: a query at p sees keys p - window < k <= p of its document."""
    q, k, v = (t.double() for t in (q, k, v))
    b, T, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scale = d**-0.5 if scale is None else scale
    pos = torch.arange(T)
    cu = torch.tensor([0, T]) if cu_seqlens is None else torch.as_tensor(cu_seqlens).long()
    doc = torch.searchsorted(cu[1:], pos, right=True)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    sink = sinks.double().view(1, hq, 1, 1).expand(b, hq, T, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def cp_groups(ring_size: int, ulysses_size: int):
    """(ring_group, ulysses_group) of the default world, Ulysses inner: flat rank = r * U + u.

    Every rank creates every group, in the same order. Not cached across checks: the harness
    destroys the groups a check created when it ends.
    """
    world = dist.get_world_size()
    if world != ring_size * ulysses_size:
        raise ValueError(f"world {world} != ring {ring_size} × ulysses {ulysses_size}")
    rank = dist.get_rank()
    ring_group = ulysses_group = None
    for u in range(ulysses_size):
        g = dist.new_group([r * ulysses_size + u for r in range(ring_size)])
        if rank % ulysses_size == u:
            ring_group = g
    for r in range(ring_size):
        g = dist.new_group([r * ulysses_size + u for u in range(ulysses_size)])
        if rank // ulysses_size == r:
            ulysses_group = g
    return ring_group, ulysses_group


def sq_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(‖out − ref‖², ‖ref‖²) so per-rank pieces can be summed into one relative error."""
    out, ref = out.detach().double(), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return float((out - ref).pow(2).sum()), float(ref.pow(2).sum())


def rel_err(pieces) -> float:
    """Relative error from per-rank (‖out − ref‖², ‖ref‖²) pairs."""
    num = sum(p[0] for p in pieces)
    den = sum(p[1] for p in pieces)
    return (num / den) ** 0.5


class SendCounter:
    """Counts what this rank sends through torch.distributed while active.

    ``p2p_sends``: bytes of every isend posted via batch_isend_irecv / isend / send;
    ``all_to_all``: (total buffer bytes, bytes leaving this rank) of each all_to_all_single.
    """

    def __init__(self):
        self.p2p_sends: list[int] = []
        self.all_to_all: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def active(self):
        orig_batch, orig_a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def batch(ops):
            for op in ops:
                if getattr(op.op, "__name__", "") == "isend":
                    self.p2p_sends.append(op.tensor.numel() * op.tensor.element_size())
            return orig_batch(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            size = dist.get_world_size(group)
            total = input.numel() * input.element_size()
            if input_split_sizes is None:
                leaving = total - total // size
            else:
                row = total // max(input.shape[0], 1)
                leaving = total - input_split_sizes[dist.get_rank(group)] * row
            self.all_to_all.append((total, leaving))
            return orig_a2a(output, input, output_split_sizes, input_split_sizes, group, async_op)

        dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a
        try:
            yield self
        finally:
            dist.batch_isend_irecv, dist.all_to_all_single = orig_batch, orig_a2a


# ----------------------------------------------------------------------------------------------
# one attention case, sharded like the real data path
# ----------------------------------------------------------------------------------------------
DOC_LENS = [13, 30, 5]  # not divisible by 2P: padded per document
FULL_DOCS = [0, 32, 48, 64]  # divisible by 16: for full (non-causal) attention, which padding would change


def _case_tensors(seed, batch, total, hq, hkv, d=8, d_v=None):
    g = torch.Generator().manual_seed(seed)
    d_v = d if d_v is None else d_v
    q = torch.randn(batch, total, hq, d, generator=g)
    k = torch.randn(batch, total, hkv, d, generator=g)
    v = torch.randn(batch, total, hkv, d_v, generator=g)
    do = torch.randn(batch, total, hq, d_v, generator=g)
    return q, k, v, do


def local_inputs(case, ring, ulysses=None, seed=0):
    """This rank's (q, k, v, dout) shards, the same shards of the float64 reference (out, dq, dk, dv),
    a mask of the real (non-pad) local tokens, and the global cu_seqlens / max_seqlen to pass.

    ``case`` = (name, causal, batch, kind, layout, heads_q, heads_kv[, options]), kind "padded"
    (layout = document lengths, padded by prepare_context_parallel_batch), "packed" (layout =
    boundaries) or "batched" (layout = seq length). ``options``: "d_v" (v's head dim), "window",
    "sinks" (True: fresh random sinks, then inputs and refs carry them and their gradient 5th)."""
    _, causal, batch, kind, layout, hq, hkv, *rest = case
    options = rest[0] if rest else {}
    if kind == "padded":
        total = sum(layout)
        cu = torch.tensor([0, *torch.tensor(layout).cumsum(0).tolist()])
        # Token ids 1..total tell which real token each padded local slot holds (0 = pad).
        ids = torch.arange(1, total + 1)[None]
        batch_cp = prepare_context_parallel_batch(ids, cu_seqlens=cu, ring=ring, ulysses=ulysses, pad_token_id=0)
        src = batch_cp.input_ids[0] - 1
        real = src >= 0
        cp_cu, cp_max = batch_cp.cu_seqlens, batch_cp.max_seqlen
    else:
        total = layout[-1] if kind == "packed" else layout
        cu = torch.tensor(layout) if kind == "packed" else None
        src = zigzag_shard(torch.arange(total)[None], 1, ring, cu, ulysses=ulysses)[0]
        real = torch.ones_like(src, dtype=torch.bool)
        cp_cu, cp_max = cu, None
    q, k, v, do = _case_tensors(seed, batch, total, hq, hkv, d_v=options.get("d_v"))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    sinks = sinks_d = None
    if options.get("sinks"):
        sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed + 7)) * 2
        sinks_d = sinks.double().requires_grad_()
    ref = reference_attention(qd, kd, vd, cu, causal, sinks=sinks_d, window=options.get("window"))
    ref.backward(do.double())

    g = torch.Generator().manual_seed(seed + 1000)

    def local(t, fill=None):
        out = t[:, src.clamp(min=0)].clone()
        out[:, ~real] = torch.randn(out[:, ~real].shape, generator=g) if fill is None else fill
        return out

    inputs = [local(q), local(k), local(v), local(do, fill=0.0)]
    refs = [t[:, src.clamp(min=0)] for t in (ref.detach(), qd.grad, kd.grad, vd.grad)]
    if sinks is not None:
        inputs.append(sinks)
        refs.append(sinks_d.grad)
    return inputs, refs, real, cp_cu, cp_max


def run_case(attn, case, ring, ulysses=None, seed=0):
    """[(‖err‖², ‖ref‖²) for out, dq, dk, dv] of this rank's real tokens, and for a case with
    sinks, of d sinks summed over every rank of the world (the sum the FSDP / DDP gradient
    reduction over the CP ranks does for a replicated parameter; equal on every rank)."""
    inputs, refs, real, cu, max_seqlen = local_inputs(case, ring, ulysses, seed)
    q, k, v, do = inputs[:4]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options = case[7] if len(case) > 7 else {}
    kwargs = {"window": options["window"]} if "window" in options else {}
    sinks = inputs[4].requires_grad_() if len(inputs) > 4 else None
    if sinks is not None:
        kwargs["sinks"] = sinks
    out = attn(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, **kwargs)
    out.backward(do)
    errors = [sq_err(a[:, real], b[:, real]) for a, b in zip((out, q.grad, k.grad, v.grad), refs)]
    if sinks is not None:
        grad = sinks.grad.clone()
        if dist.is_initialized():
            dist.all_reduce(grad)
        errors.append(sq_err(grad, refs[4]))
    return errors
