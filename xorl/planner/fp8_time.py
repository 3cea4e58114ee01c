"""FP8 GEMMs in xorl-plan's step time (train.fp8): which GEMMs run in FP8, at what rate, and their casts.

Which (read from xorl's code, not torchao's): each xorl.nn.linear.Linear a decoder layer builds runs its
forward, input-gradient (dgrad) and weight-gradient (wgrad) GEMM in FP8 (xorl_kernels/fp8/linear.py, the
ops xorl::fp8_linear and its backward; the TP linears the same three, xorl/nn/tp_matmul.py): the
attention projections (q, k, v or merge_qkv's qkv, o; latent attention's q or q_a / q_b, kv_a, kv_b) and a
dense layer's gate, up (or gate_up) and down. The routed experts' grouped GEMMs are FP8 under blockwise
only (xorl/nn/moe_experts.py experts_run_fp8). lm_head, the router, a shared expert and its gate are
nn.Linear: train.dtype. A frozen base weight (LoRA) has no wgrad, in FP8 as in bf16.

Rate: the FP8 peak (--fp8-peak-tflops; default FP8_PEAK_RATIO x --peak-tflops) times efficiency.json's
"fp8" fraction of the recipe by smallest dimension (experts: times the grouped curve), or the HBM time of
the GEMM's bytes (1 byte an fp8 operand element; outputs in their dtype, the dense wgrad's fp32), or one
launch, whichever is longest: step_time.py's rule for bf16 GEMMs.

Casts, bandwidth-bound at hbm_fraction of --hbm-gbps, each kernel at least a launch (step_time's rule
for element-wise work). Every GEMM quantises both operands on the fly, the weight in forward and again in
backward (nothing FP8 is saved between them), on a GPU with the fused Triton kernels of
xorl_kernels/fp8/triton_quantize.py: each loads its tiles through the operand's strides (a transposed
operand, dgrad's w^T and wgrad's dy^T / x^T, costs what the operand itself does: no copy), masks partial
blocks (no pad, no crop) and writes q and the scales. One quantisation of n = lead x R x C elements of a
bytes in br x bc blocks (OPERANDS of xorl_kernels/fp8/linear.py), its bytes those the kernels load and
store (tests/unit/planner/test_fp8_time.py holds them to an interpreter trace of the real call):
  blockwise (1 x 128 activations and gradients, 128 x 128 weights): one pass, a n + n + 4 a block's
     scale; 1 launch;
  rowwise (1 x C): a n + n + 4 R when a row fits one 128-column chunk, else the row strip is read twice
     (amax pass, cast pass): 2 a n + n + 4 R; 1 launch;
  tensorwise: a zero fill of the amax (4 bytes), the amax kernel (a n, and an atomic max of 8 bytes per
     64 x 128 tile), the cast (a n + n, the amax loaded once per tile: 4, the scale: 4): 2 a n + n +
     12 tiles + 8; 3 launches.
The 4-byte amax and the 8 G bytes of sizes every program loads are L2 hits on a GPU; they are counted
as loaded (under 0.3% of the bytes on the modelled shapes), so the count is the kernels' own.
The experts' wgrad quantises x and dy in 1 x 128 token tiles that never straddle experts
(quantize_token_tiles: one kernel over the static tile bound ceil(rows / 128) + experts x 64-column
chunks, each loading the experts' int64 sizes to find its tile: (a + 1) an element, 4 a tile and column,
8 experts a program; the tile map, group_token_tiles, still plain torch ops: 128 a row).

A TP column op (q, k, v; gate, up: one op, xorl/nn/tp_fp8.py) casts its input once for all its members,
on this rank's t / tp token shard under sequence parallel (the whole replicated input without): forward x,
and x^T for the weight gradients, each one quantisation of the shard (tensorwise and the plain path's
rowwise x^T with the group's amax, all-reduced: the same kernels' bytes, the all-reduce priced with the
gather in tp_time.py); the gather then moves float8 bytes and the scales that are not shared
(``column_gather``, which tp_time.py prices, with the assembly copy of the gathered x^T). Each member
casts its own dy (dgrad) and dy^T (wgrad). The weights are cast once per op call, the ring's chunks
share them.

Around the GEMMs: a bias is an add of its own (bf16's addmm fuses it); the wgrad of a linear outside
TP comes back fp32 and is cast to the weight's dtype (4 + a a weight element: bf16's F.linear writes it
directly; the TP linears cast in both); rowwise pads its two scale vectors, blockwise builds its
group-size tensor. With train.fp8_all_gather FSDP2 hands the GEMMs the
weight already cast (xorl/nn/fp8_all_gather.py): its forward operand costs one launch, dgrad's w^T a
contiguous copy of the fp8 bytes. TP with tp_overlap and sequence parallel above the ring threshold
(t h >= DEFAULT_OVERLAP_MIN_NUMEL, xorl/nn/tp_comm.py): each of the tp sequence chunks runs its own
GEMMs (each its own launches), the column forward and row dgrad copy each chunk's result into place
(2a an element) and the wgrad adds tp - 1 fp32 partials (12 a weight element).

Recompute. Full: the forward again, FP8 included (step_time's recompute = forward). Selective
(xorl/parallel/data_parallel.py): every FP8 GEMM is one op whose output the policy keeps (xorl::fp8_linear,
xorl::fp8_grouped_gemm, a TP linear op), its casts inside it, so nothing FP8 runs again; under
every_other_matmul an FP8 linear counts as the one dense matmul it is (a TP linear as its GEMMs), and a
recomputed one runs its casts and FP8 GEMM again in place of step_time's bf16 GEMM.

Compiled (train.compile): the FP8 GEMMs are custom ops, one node each in a block's graph, so the casts
stay the Triton kernels above (compile fuses no cast into a neighbouring element-wise op: torchao's
compiled Float8, whose casts are traced ops, does) and what compile fuses is the element-wise work
around them, step_time.py's compiled branch (elementwise_forward). The wgrad's cast to the weight's dtype
runs outside the op, its own kernel either way.

The result is a difference added to step_time.py's layer: the FP8 GEMMs and their casts in place of
the bf16 GEMMs step_time priced for the same modules, grouped as it groups them (q, k, v as one GEMM
of their summed width, gate and up as one; the casts per module), so fp8: none adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xorl.planner.activations import block_matmuls, recomputed_matmuls

# NVIDIA H100 SXM datasheet (nvidia.com/en-us/data-center/h100): FP8 tensor core 3,958 TFLOPS and BF16
# 1,979 "with sparsity", i.e. 1,979 and 989 dense. H200 and H800 share the H100's tensor cores.
FP8_PEAK_RATIO = 2.0
_TRANSPOSED = {"x": False, "w": False, "dy": False, "w_t": True, "dy_t": True, "x_t": True}


def _tiles() -> tuple[int, int, int, int]:
    """The kernels' tile shapes: (rows, columns) of an element-wise tile, the token tile, its columns."""
    from xorl_kernels.fp8.triton_quantize import TILE_C, TILE_R, TOKEN_COLS, TOKEN_TILE

    return TILE_R, TILE_C, TOKEN_TILE, TOKEN_COLS


def quantize_cost(rows: float, cols: float, block: tuple, a: int, lead: int = 1) -> tuple[float, int]:
    """(bytes, launches) of quantize_blocks' Triton kernels on ``lead`` stacked [rows, cols] operands of
    ``a`` bytes an element in ``block`` = (block_rows, block_cols) blocks, None for a whole dim (module
    docstring); a transposed operand is read in place and costs the same."""
    tile_r, tile_c, _, _ = _tiles()
    n = lead * rows * cols
    if block == (None, None):
        tiles = lead * math.ceil(rows / tile_r) * math.ceil(cols / tile_c)
        return 2 * a * n + n + 12 * tiles + 8 * lead, 3
    if block == (1, None):
        passes = 1 if cols <= tile_c else 2
        return passes * a * n + n + 4 * lead * rows, 1
    br = rows if block[0] is None else min(block[0], rows)
    bc = cols if block[1] is None else min(block[1], cols)
    return a * n + n + 4 * lead * math.ceil(rows / br) * math.ceil(cols / bc), 1


def token_tiles_cost(rows: float, cols: float, groups: int, a: int) -> tuple[float, int]:
    """(bytes, launches) of quantize_token_tiles' kernel on [rows, cols] sorted over ``groups`` experts."""
    _, _, token_tile, token_cols = _tiles()
    tiles = math.ceil(rows / token_tile) + groups
    programs = tiles * math.ceil(cols / token_cols)
    return (a + 1) * rows * cols + 4 * tiles * cols + 8 * groups * programs, 1


def group_tiles_cost(rows: float, groups: int) -> tuple[float, int]:
    """(bytes, launches) of group_token_tiles over ``rows`` rows sorted into ``groups`` (int64 index maps)."""
    return 128 * rows + 184 * groups, 17


@dataclass(frozen=True)
class Fp8Gemm:
    """FP8 modules priced as one GEMM, grouped as step_time.py groups the bf16 ones."""

    modules: tuple[tuple[str, float, bool], ...]  # (name in the layer, output features on this rank, bias)
    m: float  # rows: tokens (the experts: routed copies)
    k: float  # input features
    kind: str  # "column" / "row": TP linears; "plain": a Linear outside TP; "experts": the grouped GEMMs
    experts: int = 0  # local experts of a grouped GEMM
    per_expert: float = 0.0  # tokens per local expert

    @property
    def n(self) -> float:
        return sum(n for _, n, _ in self.modules)


def fp8_gemms(spec, moe: bool, recipe: str, tp: int, ep: int, t: float) -> list[Fp8Gemm]:
    """The GEMMs one decoder layer runs in FP8 under ``recipe`` on a rank with t tokens (module docstring)."""
    if recipe == "none":
        return []
    from xorl.nn.moe_experts import experts_run_fp8

    h, heads, bias = spec.hidden_size, spec.num_attention_heads, spec.attention_bias
    col, row = ("column", "row") if tp > 1 else ("plain", "plain")

    def one(name, n, k, kind, has_bias=False, m=t):
        return Fp8Gemm(((name, n, has_bias),), m, k, kind)

    if spec.kv_lora_rank:  # latent attention: the down-projections replicated (plain Linears under TP)
        d_qk, d_v, rank = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim, spec.q_lora_rank
        out = ([one("self_attn.q_proj", heads * d_qk / tp, h, col)] if rank is None else
               [one("self_attn.q_a_proj", rank, h, "plain", bias),
                one("self_attn.q_b_proj", heads * d_qk / tp, rank, col)])
        out += [one("self_attn.kv_a_proj_with_mqa", spec.kv_lora_rank + spec.qk_rope_head_dim, h, "plain", bias),
                one("self_attn.kv_b_proj", heads * (spec.qk_nope_head_dim + d_v) / tp, spec.kv_lora_rank, col),
                one("self_attn.o_proj", h, heads * d_v / tp, row, bias)]
    else:
        hq, hkv = heads * spec.head_dim / tp, spec.num_key_value_heads * spec.head_dim / tp
        qkv = ((("self_attn.qkv_proj", hq + 2 * hkv, bias),) if spec.merge_qkv else
               tuple((f"self_attn.{x}_proj", w, bias) for x, w in (("q", hq), ("k", hkv), ("v", hkv))))
        out = [Fp8Gemm(qkv, t, h, col), one("self_attn.o_proj", h, hq, row, spec.o_proj_bias)]
    if moe:
        if experts_run_fp8(recipe):  # on this TP rank's token shard, the E / ep local experts
            k, inter, experts = spec.num_experts_per_tok, spec.moe_intermediate_size, spec.num_experts
            tokens, local = t / tp * k, experts // ep
            out += [Fp8Gemm((("mlp.experts.gate_up_proj", 2 * inter, False),), tokens, h, "experts", local,
                            tokens / local),
                    Fp8Gemm((("mlp.experts.down_proj", h, False),), tokens, inter, "experts", local, tokens / local)]
        return out
    inter, b = spec.intermediate_size / tp, spec.mlp_bias
    gate_up = ((("mlp.gate_up_proj", 2 * inter, b),) if spec.merge_gate_up else
               (("mlp.gate_proj", inter, b), ("mlp.up_proj", inter, b)))
    return out + [Fp8Gemm(gate_up, t, h, col), one("mlp.down_proj", h, inter, row, b)]


@dataclass(frozen=True)
class Fp8Layer:
    """Seconds to add to one decoder layer's forward, backward and recompute (step_time.py _Layer)."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0


@dataclass(frozen=True)
class ColumnGather:
    """What an FP8 column op's input gather moves (xorl/nn/tp_fp8.py): bytes of the gathered operand,
    the whole tensor's as tp_time.py counts them (1 an element, plus the scales that travel), and of
    the amaxes it all-reduces first (the plain path's tensorwise x / x^T, rowwise x^T, straddling tiles)."""

    forward: float
    backward: float
    forward_reduce: float = 0.0
    backward_reduce: float = 0.0


def column_gather(recipe: str, t: float, width: float, tp: int, ring: bool, tiles_local: bool) -> ColumnGather:
    """The gathers of a column op with ``width`` input features over t tokens (all tp ranks'); ``tiles_local``:
    every shard's rows are whole 1 x 128 token tiles (s / tp % 128 == 0)."""
    elements = t * width
    x_scales = {"tensorwise": 4 * tp if ring else 0, "rowwise": 4 * t,
                "blockwise": 4 * t * math.ceil(width / 128)}[recipe]
    if ring:  # each chunk's own scales travel with it; nothing is reduced
        xt_scales = {"tensorwise": 4 * tp, "rowwise": 4 * width * tp,
                     "blockwise": 4 * width * tp * math.ceil(t / tp / 128)}[recipe]
        return ColumnGather(elements + x_scales, elements + xt_scales)
    forward_reduce = 4 if recipe == "tensorwise" else 0
    if recipe == "blockwise" and tiles_local:
        return ColumnGather(elements + x_scales, elements + 4 * width * t / 128)
    backward_reduce = {"tensorwise": 4, "rowwise": 4 * width, "blockwise": 4 * width * math.ceil(t / 128)}[recipe]
    return ColumnGather(elements + x_scales, elements, forward_reduce, backward_reduce)


class Fp8Pricer:
    """Times of one group's three FP8 passes, and of the bf16 GEMM step_time priced for it."""

    def __init__(self, c, recipe: str, tp: int, ring: bool, all_gathered: bool, sp: bool = True):
        from xorl_kernels.fp8.linear import OPERANDS

        self.c, self.recipe, self.a, self.tp, self.ring, self.all_gathered = c, recipe, c.a, tp, ring, all_gathered
        self.sp = sp
        self.block = {role: block for role, (block, _) in OPERANDS[recipe].items()}
        hw = c.hw
        self.flops = (getattr(hw, "fp8_peak_tflops", None) or FP8_PEAK_RATIO * hw.peak_tflops) * 1e12
        self.gemm_launches = {"tensorwise": 0, "rowwise": 2, "blockwise": 1}[recipe]  # beside the GEMM's own

    def bf16(self, g: Fp8Gemm) -> float:
        if g.kind == "experts":
            return self.c.gemm(g.m, g.n, g.k, weight_elems=g.experts * g.n * g.k,
                               fraction=self.c.eff.grouped(g.per_expert, g.n, g.k))
        return self.c.gemm(g.m, g.n, g.k)

    def _gemm(self, g: Fp8Gemm, m, n, k, read: float, out_bytes: float) -> float:
        eff = self.c.eff
        fraction = (eff.fp8_grouped(self.recipe, g.per_expert, n, k) if g.kind == "experts"
                    else eff.fp8_gemm(self.recipe, m, n, k))
        return max(2 * m * n * k / (self.flops * fraction), (read + out_bytes) / self.c.hbm, eff.launch_s)

    def _chunks(self, g: Fp8Gemm) -> int:
        return self.tp if self.ring and g.kind in ("column", "row") else 1

    def _weight(self, role: str, n: float, k: float) -> tuple[float, int]:
        """Once per op call: the ring's chunks share it (xorl/nn/tp_matmul.py _fp8_weights)."""
        if self.all_gathered:  # already float8 (xorl_kernels/fp8/linear.py weight_operand)
            return (0, 1) if role == "w" else (2 * n * k, 2)
        rows, cols = (n, k) if role == "w" else (k, n)
        return quantize_cost(rows, cols, self.block[role], self.a)

    def _input(self, g: Fp8Gemm, role: str) -> tuple[float, int]:
        """A column op's input cast once for its members ("x" [tokens, k] or "x_t" [k, tokens]): its
        t / tp token shard under sequence parallel (xorl/nn/tp_fp8.py)."""
        tokens = g.m / self.tp if self.sp else g.m
        rows, cols = (tokens, g.k) if role == "x" else (g.k, tokens)
        return quantize_cost(rows, cols, self.block[role], self.a)

    def _act(self, role: str, rows: float, cols: float, chunks: int) -> tuple[float, int]:
        nbytes, launches = quantize_cost(rows / chunks if not _TRANSPOSED[role] else rows,
                                         cols / chunks if _TRANSPOSED[role] else cols,
                                         self.block[role], self.a)
        return chunks * nbytes, chunks * launches

    def forward(self, g: Fp8Gemm) -> float:
        casts = self.c.elementwise(*self.forward_casts(g))
        weights = g.experts * g.n * g.k if g.kind == "experts" else g.n * g.k
        return casts + self._gemm(g, g.m, g.n, g.k, g.m * g.k + weights, self.a * g.m * g.n)

    def forward_casts(self, g: Fp8Gemm) -> tuple[float, int]:
        """(bytes, launches) of the forward's work beside its GEMM."""
        a, c = self.a, self._chunks(g)
        if g.kind == "experts":
            x = quantize_cost(g.m, g.k, self.block["x"], a)
            w = quantize_cost(g.k, g.n, self.block["w"], a, lead=g.experts)
            work = (x[0] + w[0], x[1] + w[1] + self.gemm_launches)
        else:
            work = list(self._input(g, "x")) if g.kind == "column" else [0.0, 0]
            for _, n, bias in g.modules:
                x = self._act("x", g.m, g.k, c) if g.kind != "column" else (0, 0)
                for nbytes, launches in (x, self._weight("w", n, g.k),
                                         ((2 * a * g.m * n + a * n, c) if bias else (0, 0)),
                                         ((2 * a * g.m * n, c) if c > 1 and g.kind == "column" else (0, 0))):
                    work[0] += nbytes
                    work[1] += launches
                work[1] += c * self.gemm_launches
        return tuple(work)

    def dgrad(self, g: Fp8Gemm) -> float:
        weights = g.experts * g.n * g.k if g.kind == "experts" else g.n * g.k
        return (self.c.elementwise(*self.dgrad_casts(g))
                + self._gemm(g, g.m, g.k, g.n, g.m * g.n + weights, self.a * g.m * g.k))

    def dgrad_casts(self, g: Fp8Gemm) -> tuple[float, int]:
        a, c = self.a, self._chunks(g)
        if g.kind == "experts":
            dy = quantize_cost(g.m, g.n, self.block["dy"], a)
            w = quantize_cost(g.k, g.n, self.block["w"], a, lead=g.experts)  # w again; its transpose is a view
            work = (dy[0] + w[0], dy[1] + w[1] + self.gemm_launches)
        else:
            work = [0.0, 0]
            for _, n, _ in g.modules:
                for nbytes, launches in (self._act("dy", g.m, n, c), self._weight("w_t", n, g.k),
                                         ((2 * a * g.m * g.k, c) if c > 1 and g.kind == "row" else (0, 0))):
                    work[0] += nbytes
                    work[1] += launches
                work[1] += c * self.gemm_launches
        return tuple(work)

    def wgrad(self, g: Fp8Gemm) -> float:
        out = self.a * g.experts * g.k * g.n if g.kind == "experts" else 4 * g.n * g.k  # weight dtype / fp32
        return self.c.elementwise(*self.wgrad_casts(g)) + self._gemm(g, g.n, g.k, g.m, g.m * (g.n + g.k), out)

    def wgrad_casts(self, g: Fp8Gemm) -> tuple[float, int]:
        a, c = self.a, self._chunks(g)
        if g.kind == "experts":
            parts = (group_tiles_cost(g.m, g.experts), token_tiles_cost(g.m, g.k, g.experts, a),
                     token_tiles_cost(g.m, g.n, g.experts, a))
            work = (sum(p[0] for p in parts), sum(p[1] for p in parts) + self.gemm_launches)
        else:
            work = list(self._input(g, "x_t")) if g.kind == "column" else [0.0, 0]
            for _, n, _ in g.modules:
                x_t = self._act("x_t", g.k, g.m, c) if g.kind != "column" else (0, 0)
                for nbytes, launches in (self._act("dy_t", n, g.m, c), x_t,
                                         ((4 + a) * n * g.k, 1) if g.kind == "plain" and a != 4 else (0, 0),
                                         (12 * n * g.k * (c - 1), c - 1)):
                    work[0] += nbytes
                    work[1] += launches
                work[1] += c * self.gemm_launches
        return tuple(work)


def fp8_layer(spec, moe: bool, p, c, t: float, sp: bool, mode: str, every_other: bool, recipe: str,
              all_gathered: bool = False) -> Fp8Layer:
    """What ``recipe`` adds to one decoder layer's times in step_time.py (negative where FP8 is faster)."""
    groups = fp8_gemms(spec, moe, recipe, p.tp, p.ep, t)
    if not groups:
        return Fp8Layer()
    from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL

    ring = p.tp > 1 and sp and p.tp_overlap and t * spec.hidden_size >= DEFAULT_OVERLAP_MIN_NUMEL
    price = Fp8Pricer(c, recipe, p.tp, ring, all_gathered and recipe == "tensorwise", sp)
    trainable = not spec.lora  # LoRA freezes the base weights: no wgrad
    forward = backward = recompute = 0.0
    for g in groups:
        bf16 = price.bf16(g)
        forward += price.forward(g) - bf16
        backward += price.dgrad(g) - bf16 + (price.wgrad(g) - bf16 if trainable else 0.0)
    # selective keeps every FP8 op's output (docstring): only every_other_matmul recomputes FP8 GEMMs
    if mode == "selective" and every_other:
        recompute += _every_other(spec, moe, p.tp, sp, c, t, groups, price)
    return Fp8Layer(forward, backward, recompute)


def _every_other(spec, moe: bool, tp: int, sp: bool, c, t: float, groups: list[Fp8Gemm], price: Fp8Pricer) -> float:
    """every_other_matmul under FP8 less what step_time priced: the same units recomputed (an FP8 linear
    is one matmul to the policy, a TP linear its GEMMs), a recomputed FP8 unit in FP8."""
    units = block_matmuls(spec, moe, tp, sp)
    # One FP8 op per unit of block_matmuls, in its order: under TP a group is one op (q, k, v; gate,
    # up), without TP each module is its own xorl::fp8_linear. The FP8 units are the attention's and a
    # dense MLP's, listed first; the experts' grouped GEMMs are no dense matmul (always kept).
    linear = [g for g in groups if g.kind != "experts"]
    if tp == 1:
        linear = [Fp8Gemm((module,), g.m, g.k, g.kind) for g in linear for module in g.modules]
    widths = [sum(n for _, _, n, _ in unit) for unit in units[:len(linear)]]
    if len(widths) != len(linear) or not all(math.isclose(w, g.n) for w, g in zip(widths, linear)):
        raise RuntimeError("fp8_time: the FP8 GEMMs do not line up with activations.block_matmuls' units")
    priced = sum(c.gemm(t * tokens, n, k) for _, tokens, n, k in recomputed_matmuls(spec, moe, tp, sp))
    actual, count = 0.0, 0
    for i, unit in enumerate(units):
        if all((count + j) % 2 == 0 for j in range(1, len(unit) + 1)):
            actual += (price.forward(linear[i]) if i < len(linear) else
                       sum(c.gemm(t * tokens, n, k) for _, tokens, n, k in unit))
        count += len(unit)
    return actual - priced
