"""FP8 GEMMs of the TP linears (train.fp8): a column op casts its input on its sequence shard, once,
and the float8 bytes travel.

Why. Under sequence parallel a column op (q, k, v or gate, up: one op for a SharedInputColumnGroup)
all-gathers its [t/P, h] input shard and multiplies the gathered [t, h] by each member's weight. Cast
after the gather, each member quantised the same gathered tensor again (forward x, and x^T for each
weight gradient), every cast touching all t tokens, and the gather moved ``train.dtype`` bytes. Here
each rank casts its shard once per op (torchao's Float8ColwiseParallel casts before the gather too),
the gather (plain collective or the overlapped ring, ``tp_comm``) moves 1 byte an element plus the
scales, and every member multiplies the gathered float8 operand. The weights are cast once per op call
(the ring's chunks share them), and dy once per GEMM as before (each member has its own).

The numbers are the ones the GEMMs multiplied before, bit for bit (tests/multirank/test_tp_fp8.py):

* plain collective: the operand is the cast of the GATHERED tensor (OPERANDS of
  xorl_kernels/fp8/linear.py: x [t, h] forward, x^T [h, t] for the weight gradient):
    forward x, rowwise / blockwise 1 x 128: the scales run along h, each token row's own: local.
    tensorwise (x and x^T share the scale): the gathered tensor's amax, an all-reduce (max) of a
      device scalar over the TP group (no host sync), then each shard cast with it.
    x^T rowwise: one scale per hidden channel over all t tokens: an all-reduce (max) of the
      shard's [h] amax vector.
    x^T blockwise, 1 x 128 token tiles over the gathered rows ([b, s] flattened): where every shard's
      s/P rows are whole tiles (s/P % 128 == 0), every tile is one rank's: local. Otherwise the tiles
      that straddle shards take their amax over the ranks: an all-reduce (max) of [tiles, h] partial
      amaxes (every rank then knows every scale, so only q travels).
  Shared scales stay home; per-row (forward) and per-tile (x^T, aligned) scales travel with q.
* ring (tp_overlap above the size cutoff): each rank's chunk is its own GEMM operand, cast with its
  own scales, as the ring always multiplied it: nothing to reduce, each chunk's scales travel with it.
  So the ring's tensorwise and rowwise x^T scales are per chunk (finer than the plain path's), and
  its tensorwise x too: the two paths agree where the power-of-2 scales of the chunks and of the
  whole coincide, which is most of the time, not always.

The gathered x^T is assembled from the rank-stacked [P, h, b, s/P] bytes: a reorder copy of 1 byte an
element (the plain gather of x in ``train.dtype`` needs one at b > 1 too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xorl.nn.tp_comm import all_gather_stacked, all_reduce_max, ring_all_gather
from xorl_kernels.fp8.linear import OPERANDS, quantize_operand, scaled_mm_nt, weight_operand
from xorl_kernels.fp8.quantize import (
    BLOCK,
    cast_token_tiles_reference,
    cast_with_amax,
    quantize_blocks,
    token_tile_amax,
)


@dataclass
class Operand:
    """An FP8 GEMM operand laid out [rows, contraction]: q, its dequantisation scales, their block."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple


def gemm(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """(a.q * a.scale) @ (b.q * b.scale)^T."""
    return scaled_mm_nt(a.q, a.scale, a.block, b.q, b.scale, b.block, out_dtype)


def operand(t2d: torch.Tensor, recipe: str, role: str) -> Operand:
    return Operand(*quantize_operand(t2d, recipe, role))


def weight(w: torch.Tensor, recipe: str, role: str) -> Operand:
    """A weight [N, K] as operand "w", or its transpose as "w_t" (dgrad)."""
    return Operand(*weight_operand(w, recipe, role))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def linear(a: torch.Tensor, recipe: str, w: Operand, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """a @ W^T (+ bias) for a [..., K] (cast here) and the cast weight: xorl_kernels' linear_forward."""
    y = gemm(operand(_rows(a), recipe, "x"), w, a.dtype).view(*a.shape[:-1], out_features)
    return y if bias is None else y.add_(bias)


def dgrad(g: torch.Tensor, recipe: str, w_t: Operand, in_features: int) -> torch.Tensor:
    """g @ W for g [..., N] (cast here) and the cast w^T: xorl_kernels' linear_dgrad."""
    return gemm(operand(_rows(g), recipe, "dy"), w_t, g.dtype).view(*g.shape[:-1], in_features)


def wgrad(g: torch.Tensor, x_t: Operand, recipe: str) -> torch.Tensor:
    """g^T @ x (float32) for g [..., N] (cast here as dy^T) and the cast x^T: linear_wgrad's GEMM."""
    return gemm(operand(_rows(g).t(), recipe, "dy_t"), x_t, torch.float32)


# -- the input shard's cast, and its gather ---------------------------------------------------------

def _abs_max(rows: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| over all elements, or along ``dim``, in float32: one reduction pass, no |x| temporary."""
    return torch.linalg.vector_norm(rows, float("inf"), dim=dim).float()


def input_shard(cfg, x: torch.Tensor, role: str, whole: bool) -> tuple[Operand, bool]:
    """This rank's input shard x [..., s/P, K] cast once as the GEMM operand ``role``: "x" [m, K]
    (forward) or "x_t" [K, m] (weight gradient), m = its tokens. ``whole``: with the scales of the
    gathered tensor (the plain collective), else its own (the ring). Also returns whether the scales
    are the same on every rank (then only q needs to travel). See the module docstring."""
    recipe, tp, stats = cfg.fp8, cfg.tp, cfg.stats
    rows = _rows(x)
    t = rows if role == "x" else rows.t()
    block, dtype = OPERANDS[recipe][role]
    tiles_local = block == (1, BLOCK) and (role == "x" or x.shape[-2] % BLOCK == 0)
    if not whole or block == (1, None) and role == "x" or tiles_local:
        return Operand(*quantize_blocks(t, *block, dtype), block), False
    if block == (None, None):  # tensorwise: the gathered tensor's amax
        amax = all_reduce_max(_abs_max(rows).reshape(1, 1), tp, stats)
    elif block == (1, None):  # rowwise x^T: each hidden channel over every token of the group
        amax = all_reduce_max(_abs_max(rows, dim=0).reshape(-1, 1), tp, stats)
    else:  # x^T in 1 x 128 token tiles that straddle shards
        return _straddling_tiles(cfg, x, rows, dtype), True
    q, qscale = cast_with_amax(t, amax, dtype)
    return Operand(q, qscale.reciprocal(), block), True


def _straddling_tiles(cfg, x: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> Operand:
    """x^T in 1 x 128 tiles of the gathered rows when s/P is no multiple of 128: each tile's amax is
    the max of its rows' partial amaxes over the ranks (one all-reduce of [tiles, K])."""
    shard, size = x.shape[-2], cfg.tp.size
    local = torch.arange(rows.shape[0], device=rows.device)
    gathered_row = local // shard * (shard * size) + cfg.tp.rank * shard + local % shard
    tile_of_row = gathered_row // BLOCK
    tiles = -(-rows.shape[0] * size // BLOCK)
    amax = all_reduce_max(token_tile_amax(rows, tile_of_row, tiles), cfg.tp, cfg.stats)
    q, scale = cast_token_tiles_reference(rows, tile_of_row, amax, dtype)
    return Operand(q.t().contiguous(), scale.t().contiguous(), (1, BLOCK))


def _assemble(stacked: torch.Tensor, batch: int, role: str) -> torch.Tensor:
    """The gathered operand from the rank-stacked shards: "x" [P, b s/P, C] -> [b s, C] in sequence
    order (rank r's rows at r s/P of each sequence), "x_t" [P, C, b s/P] -> [C, b s]."""
    size = stacked.shape[0]
    if role == "x":
        return stacked.view(size, batch, -1, stacked.shape[-1]).transpose(0, 1).reshape(-1, stacked.shape[-1])
    channels = stacked.shape[1]
    return stacked.view(size, channels, batch, -1).permute(1, 2, 0, 3).reshape(channels, -1)


def gathered_input(cfg, x: torch.Tensor, role: str) -> Operand:
    """The gathered input as operand ``role``, cast on this rank's shard and all-gathered in float8."""
    op, shared = input_shard(cfg, x, role, whole=True)
    parts = all_gather_stacked([op.q.view(torch.uint8)] + ([] if shared else [op.scale]), cfg.tp, cfg.stats)
    batch = x.numel() // (x.shape[-1] * x.shape[-2])
    q = _assemble(parts[0], batch, role).view(op.q.dtype)
    return Operand(q, op.scale if shared else _assemble(parts[1], batch, role), op.block)


def ring_input(cfg, x: torch.Tensor, role: str, consume) -> None:
    """``consume(chunk operand, src_rank)`` for every rank's shard, cast on its rank and passed around
    the ring in float8 with its scales (tp_comm.ring_all_gather)."""
    op, _ = input_shard(cfg, x, role, whole=False)

    def arrived(chunk, src: int) -> None:
        q, scale = chunk
        consume(Operand(q.view(op.q.dtype), scale, op.block), src)

    ring_all_gather((op.q.view(torch.uint8), op.scale), cfg.tp, arrived, cfg.stats)


# -- the column op's FP8 GEMMs (xorl/nn/tp_matmul.py calls these under train.fp8) ----------------------

def column_forward(cfg, x: torch.Tensor, weights, biases, ring: bool) -> list[torch.Tensor]:
    """outputs_j = gather_seq(x) @ W_j^T + b_j in FP8: the input cast once for every member."""
    recipe = cfg.fp8
    ws = [weight(w, recipe, "w") for w in weights]

    def outputs(xq: Operand, lead) -> list[torch.Tensor]:
        outs = []
        for w, wq, b in zip(weights, ws, biases):
            y = gemm(xq, wq, x.dtype).view(*lead, w.shape[0])
            outs.append(y if b is None else y.add_(b))
        return outs

    if not cfg.sequence_sharded:
        return outputs(operand(_rows(x), recipe, "x"), x.shape[:-1])
    shard = x.shape[-2]
    lead = (*x.shape[:-2], shard * cfg.tp.size)
    if not ring:
        return outputs(gathered_input(cfg, x, "x"), lead)
    outs = [x.new_empty(*lead, w.shape[0]) for w in weights]

    def consume(xq: Operand, src: int) -> None:
        for out, y in zip(outs, outputs(xq, x.shape[:-1])):
            out.narrow(-2, src * shard, shard).copy_(y)

    ring_input(cfg, x, "x", consume)
    return outs


def column_wgrads(cfg, x: torch.Tensor, grads, need_dw, ring: bool) -> list[torch.Tensor | None]:
    """[dW_j (float32) or None]: gather_seq(x)^T cast once for every member's weight gradient."""
    recipe = cfg.fp8
    if not cfg.sequence_sharded or not ring:
        x_t = operand(_rows(x).t(), recipe, "x_t") if not cfg.sequence_sharded else gathered_input(cfg, x, "x_t")
        return [wgrad(g, x_t, recipe) if need else None for g, need in zip(grads, need_dw)]
    shard = x.shape[-2]
    dws: list[torch.Tensor | None] = [None] * len(grads)

    def consume(x_t: Operand, src: int) -> None:
        for j, g in enumerate(grads):
            if need_dw[j]:
                part = wgrad(g.narrow(-2, src * shard, shard), x_t, recipe)
                dws[j] = part if dws[j] is None else dws[j].add_(part)

    ring_input(cfg, x, "x_t", consume)
    return dws
