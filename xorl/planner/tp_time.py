"""Tensor parallelism's share of the step time: the collectives of xorl's TP linears and what they cost.

What xorl runs (xorl/nn/tp_matmul.py, tp_comm.py, tp_linear_ops.py; counted per decoder layer and
microbatch of t tokens, P = tensor_parallel_size). Each TP region is a column op (q/k/v sharing one
gathered input, MLA's up-projections of its latents, gate/up) and a row op (o_proj, down_proj); an
MoE block runs on token shards and has none. Under sequence parallel (SP), per region:
  forward    the column op all-gathers its input, the row op reduce-scatters its output [t, h];
  backward   the column op saves only its shard, so it gathers its input again for the weight
             gradient and reduce-scatters the input gradient; the row op gathers the output gradient;
  recompute  full: the forward again; selective every_other_matmul: each row op it recomputes
             (o_proj: activations.recomputed_matmuls) reduce-scatters again.
The root group adds the vocabulary-parallel embedding (reduce-scatter forward, gather backward) and
the lm_head, a column op. Without SP the row op all-reduces its output (forward) and the column op
its input gradient, started before its weight-gradient GEMMs and waited after them (backward);
tp_overlap changes nothing there (its ring needs a sequence shard).

Plain collectives (tp_overlap false, or a gathered activation under DEFAULT_OVERLAP_MIN_NUMEL):
exposed, at the collective rate of _Cost.collective. NCCL's buffer is rank-stacked [P, b, s/P, h]:
with b = micro_batch_size > 1 the gather's output and the reduce-scatter's input are reordered by a
copy of the whole [b, s, h] tensor on the compute stream (2 a t h bytes; none at b = 1).

Ring (tp_overlap under SP, xorl/nn/tp_comm.py): P - 1 exchanges of one [t/P, width] chunk with the
ring neighbours through NCCL send/recv (at p2p_fraction of NVLink, one latency each), each behind
one chunk GEMM of its own op: forward, its GEMM; column backward, the weight-gradient GEMMs for the
gather and the input-gradient GEMMs for the reduce-scatter; row backward, both. Per exchange the
NCCL kernels hold SMs while the GEMM runs (overlap_interference of the overlapped time, the GEMM
being slower for it) and what the GEMM does not cover is exposed. The chunk GEMMs split m into P
row blocks (the weight gradients split k: same tiles, no extra wave): each runs at its own shape's
efficiency and ends in a partial wave of sms x tile tiles (half a wave on average; xorl queues them
on one stream, so a chunk's tail never overlaps the next: the magnified wave quantisation of
PyTorch's async-TP post). The reduce-scatter adds each received partial on the compute stream
(3 a (t/P) h bytes per exchange), and at b > 1 a chunk's rows are strided in [b, s, ...], so the
op's rank-local operand is staged through a copy: the column output / row input forward (2 a t w),
the two gradient operands backward (4 a t w).

train.fp8 (xorl/nn/tp_fp8.py): an FP8 column op casts its input shard before the gather, so its gathers
(forward x, backward x^T; plain and ring) move 1 byte an element plus the scales that travel, after
the all-reduces (max) of the amaxes the plain path needs (fp8_time.column_gather); the gathered x^T is
assembled from the rank-stacked bytes by a copy at any batch. The input gradient's reduce-scatter and
the row ops stay in train.dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL


@dataclass(frozen=True)
class TPOp:
    """One TP linear: its GEMMs' (n, k) with m = the tokens, and the per-token width it moves:
    a column op gathers its input (``width`` = the input's), a row op reduces its output (h)."""
    gemms: tuple[tuple[float, float], ...]
    width: float
    column: bool

    @property
    def local_width(self) -> float:
        """Width of the operand a ring chunk strides through: column output, row input."""
        return sum(n for n, _ in self.gemms) if self.column else sum(k for _, k in self.gemms)


def regions(spec, moe: bool, tp: int) -> list[tuple[TPOp, TPOp]]:
    """(column op, row op) of each TP region of one decoder layer, shapes on this TP rank."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    if spec.kv_lora_rank:  # MLA: q (or q_b) and kv_b gather their latents, one op here
        d_qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q_in = h if spec.q_lora_rank is None else spec.q_lora_rank
        column = TPOp(((heads * d_qk / tp, q_in), (heads * (spec.qk_nope_head_dim + spec.v_head_dim) / tp,
                                                    spec.kv_lora_rank)),
                      q_in + spec.kv_lora_rank + spec.qk_rope_head_dim, True)
        out = [(column, TPOp(((h, heads * spec.v_head_dim / tp),), h, False))]
    else:
        hq, hkv = heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        out = [(TPOp((((hq + 2 * hkv) / tp, h),), h, True), TPOp(((h, hq / tp),), h, False))]
    if not moe:
        inter = spec.intermediate_size / tp
        out.append((TPOp(((2 * inter, h),), h, True), TPOp(((h, inter),), h, False)))
    return out


@dataclass
class TPTime:
    exposed: float = 0.0  # communication the compute stream waits for
    compute: float = 0.0  # compute-stream time TP adds: interference, copies, partial sums, chunk tails

    def __add__(self, other: TPTime) -> TPTime:
        return TPTime(self.exposed + other.exposed, self.compute + other.compute)

    def __mul__(self, times: int) -> TPTime:
        return TPTime(self.exposed * times, self.compute * times)


def _plain(c, nbytes: float, tp: int, kind: str, batch: int) -> TPTime:
    """An exposed collective; at batch > 1 its rank-stacked buffer is reordered by a copy."""
    copy = 2 * nbytes / c.hbm if batch > 1 and kind != "all_reduce" else 0.0
    return TPTime(c.collective(nbytes, tp, 1, kind), copy)


def _tail(c, m: float, n: float, k: float) -> float:
    """Half a wave of the GEMM [m, k] x [k, n]: sms tiles of tile_m x tile_n, 2 tile_m tile_n k FLOPs each."""
    e = c.eff
    return 0.5 * e.sms * e.tile_m * e.tile_n * 2 * k / (c.flops * e.gemm(m, n, k))


def _ring(c, nbytes: float, tp: int, chunk_gemms: float, full_gemms: float, tails: float, reduce: bool) -> TPTime:
    """P - 1 exchanges of nbytes / P, each behind one of the P chunk GEMMs (``chunk_gemms``: their sum;
    ``full_gemms``: the same GEMMs unsplit, which the layer's compute already counts)."""
    transfer = nbytes / tp / c.p2p + c.eff.latency_nvlink_s
    gemm = chunk_gemms / tp
    slowdown = c.eff.overlap_interference * min(transfer, gemm)
    exposed = (tp - 1) * max(0.0, transfer - gemm - slowdown)
    adds = 3 * nbytes * (tp - 1) / tp / c.hbm if reduce else 0.0
    return TPTime(exposed, (tp - 1) * slowdown + adds + chunk_gemms - full_gemms + tails)


def op_time(c, op: TPOp, t: float, tp: int, batch: int, overlap: bool, forward: int, backward: int,
            fp8: str = "none") -> TPTime:
    """A TP op under SP over ``forward`` forward passes (the recompute's included) and ``backward``.
    ``fp8``: the column op's recipe (train.fp8), whose input gathers move float8 (fp8_time.column_gather)."""
    nbytes = c.a * t * op.width
    ring = overlap and t * op.width >= DEFAULT_OVERLAP_MIN_NUMEL  # xorl's use_ring
    gathered, amax = (nbytes, nbytes), TPTime()
    if op.column and fp8 != "none":  # the shard cast once, gathered in float8 (xorl/nn/tp_fp8.py)
        from xorl.planner.fp8_time import column_gather

        g = column_gather(fp8, t, op.width, tp, ring, (t / batch / tp) % 128 == 0)
        gathered = (g.forward, g.backward)
        reduce_time = [c.collective(r, tp, 1, "all_reduce") if r else 0.0 for r in (g.forward_reduce,
                                                                                  g.backward_reduce)]
        amax = TPTime(reduce_time[0]) * forward + TPTime(reduce_time[1]) * backward
    if not ring:
        gather, reduce = (_plain(c, nbytes, tp, kind, batch) for kind in ("all_gather", "reduce_scatter"))
        if not op.column:
            return reduce * forward + gather * backward
        if fp8 == "none":
            return gather * forward + (gather + reduce) * backward
        # float8: x as bf16's gather (reordered at b > 1), x^T assembled from [P, k, b, s/P] by a copy at any b
        regather = TPTime(c.collective(gathered[1], tp, 1, "all_gather"), 2 * gathered[1] / c.hbm)
        return _plain(c, gathered[0], tp, "all_gather", batch) * forward + (regather + reduce) * backward + amax
    m, full = t / tp, sum(c.gemm(t, n, k) for n, k in op.gemms)
    rows = tp * sum(c.gemm(m, n, k) for n, k in op.gemms)  # forward and input gradient: m split in P
    wgrad = tp * sum(c.gemm(n, k, m) for n, k in op.gemms)  # weight gradient: its reduction split
    fwd_tails = (tp - 1) * sum(_tail(c, m, n, k) for n, k in op.gemms)
    dgrad_tails = (tp - 1) * sum(_tail(c, m, k, n) for n, k in op.gemms)
    stage = TPTime(0.0, 2 * c.a * t * op.local_width / c.hbm if batch > 1 else 0.0)
    fwd = _ring(c, gathered[0], tp, rows, full, fwd_tails, reduce=not op.column) + stage
    if op.column:  # the input gathered for the weight gradient, then the input gradient reduced
        bwd = _ring(c, gathered[1], tp, wgrad, full, 0.0, False) + _ring(c, nbytes, tp, rows, full, dgrad_tails, True)
    else:  # the output gradient gathered for both GEMMs
        bwd = _ring(c, nbytes, tp, rows + wgrad, 2 * full, dgrad_tails, reduce=False)
    return fwd * forward + (bwd + stage * 2) * backward


def all_reduce_time(c, op: TPOp, t: float, tp: int, forward: int, backward: int) -> TPTime:
    """Without SP: the row op's all-reduce per forward pass, exposed; the column op's of its input
    gradient behind its weight-gradient GEMMs."""
    ar = c.collective(c.a * t * op.width, tp, 1, "all_reduce")
    if not op.column:
        return TPTime(ar) * forward
    return TPTime(*c.overlapped(ar, sum(c.gemm(t, n, k) for n, k in op.gemms))) * backward


def layer_time(c, spec, moe: bool, t: float, tp: int, batch: int, sp: bool, overlap: bool, mode: str,
               recomputed_rows: set[float], fp8: str = "none") -> TPTime:
    """One decoder layer and microbatch; ``recomputed_rows``: the input widths of the row ops that
    selective checkpointing recomputes (each reduces its output again); ``fp8``: train.fp8."""
    total = TPTime()
    for column, row in regions(spec, moe, tp):
        for op in (column, row):
            forward = 1 + (mode == "full" or (not op.column and op.gemms[0][1] in recomputed_rows))
            total += (op_time(c, op, t, tp, batch, overlap, forward, 1, fp8) if sp
                      else all_reduce_time(c, op, t, tp, forward, 1))
    return total


def root_time(c, h: float, vocab: float, t: float, tp: int, batch: int, sp: bool, overlap: bool,
              first: bool, last: bool) -> TPTime:
    """Per microbatch: the vocabulary-parallel embedding (first stage: a reduce of [t, h] forward,
    under SP a gather backward) and lm_head (last stage: a column op over ``vocab`` rows)."""
    head, embed, total = TPOp(((vocab, h),), h, True), TPOp((), h, False), TPTime()
    if sp:
        total += op_time(c, embed, t, tp, batch, False, 1, 1) * first
        return total + op_time(c, head, t, tp, batch, overlap, 1, 1) * last
    return total + all_reduce_time(c, embed, t, tp, 1, 0) * first + all_reduce_time(c, head, t, tp, 0, 1) * last
