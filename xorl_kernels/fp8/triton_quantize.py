"""Triton kernels: the FP8 casts of ``quantize.py`` fused, each block read once from HBM.

One program loads a tile of the operand through its strides (a transposed view is read as it lies
in memory, so dgrad's w^T and wgrad's dy^T / x^T need no ``.contiguous()`` copy), takes the amax of
each scale block in it, computes the scale, casts with saturation and stores q contiguous in the
operand's logical layout and the DEQUANTISATION scale; partial blocks are masked (no pad, no crop).

- 1 x 128 tiles (``_TILE``) and rowwise rows that fit one 128-column chunk: a [64, 128] tile per
  program, one amax per row (3 bytes an element on bf16: read 2, write 1; + 4 a scale);
- 128 x 128 blocks (``_BLOCK``): a [128, 128] tile per program, one amax;
- rowwise on longer rows (``_ROW``): a strip of 16 rows per program, its columns walked twice in
  128-wide chunks, once for the per-row amax and once for the cast (the operand is read twice);
- tensorwise: ``_amax_kernel`` folds each [64, 128] tile's amax into a zeroed device scalar per
  stacked tensor with ``atomic_max`` (no host sync), then the cast kernel (``_GIVEN``) reads it;
  ``cast_with_amax`` (an FSDP shard cast with the whole weight's amax) is that cast alone, and with one
  amax per row (``AMAX_ROWS``: a TP shard's x^T with each channel's amax over the group, tp_fp8.py)
  a [64, 128] tile that loads its 64 rows' amaxes;
- the experts' weight-gradient token tiles (``_cast_token_tiles_kernel``): 128-token tiles that start
  at each expert's first row, found on the device from ``group_sizes`` as the grouped GEMMs find
  theirs (``_group_of_tile``), one scale per tile and column.

The scale is torchao's arithmetic bit for bit (``torchao.float8.float8_utils``: ``amax_to_scale``
with ``round_scales_to_power_of_2=True``): r = float32(fmax / max(float64(amax), 1e-12)), then
exp2(floor(log2(r))) with log2 evaluated in float32. No libm here: r = m 2^k with m in [1, 2), and
floor(log2 r) is k, except where float32 rounds log2 r UP to the integer k + 1, which happens for r
within a few ulps below 2^(k+1): log2 r = (k + 1) - u/ln2 + O(u^2) for r = 2^(k+1) (1 - u), and it
rounds to k + 1 when u/ln2 is under half the float32 gap below k + 1, 2^(E-24) with E = floor(log2
|w|), w = k for k + 1 > 0 and -(k + 1) otherwise. With u = j 2^-24 (j ulps of r below 2^(k+1)) that
is j <= floor(2^E ln 2) (none of 2^E ln 2, E <= 7, lies near an integer, so no tie is in reach).
``tests/unit/kernels/test_fp8_cast_kernels.py`` holds this to torch's float32 log2 on every binade's window.

The saturating cast: clamp to +-fmax, then round to nearest even: the hardware conversion on a GPU
(``cvt.rn.satfinite``); under the interpreter a bit-exact software rounding stored as bytes, because
the interpreter's float8 downcast rounds ties away from even and lets a mantissa carry spill into
the exponent (triton/runtime/interpreter.py ``_convert_float``). Both give torch's ``.to(float8)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xorl_kernels.dispatch import triton_interpreting
from xorl_kernels.expert_gemm.triton_kernels import _block_g, _group_of_tile

TILE_R, TILE_C = 64, 128  # an element-wise tile: 64 rows x one 128-column scale tile
ROW_STRIP = 16  # rows a rowwise program walks: wgrad's x^T has only K rows, so keep the grid wide
WEIGHT_BLOCK = 128
TOKEN_TILE, TOKEN_COLS = 128, 64  # one 128-token scale tile x 64 columns
_TILE, _BLOCK, _ROW, _GIVEN = 0, 1, 2, 3  # the cast kernel's modes (module docstring)
_LN2_Q24 = tl.constexpr(11629079)  # floor(ln 2 * 2^24)


@triton.jit
def _scales(amax, FMAX: tl.constexpr):
    """(quantisation, dequantisation) scales of ``amax`` (float32, >= 0): torchao's, exactly."""
    r = (FMAX / tl.maximum(amax.to(tl.float64), tl.full(amax.shape, 1e-12, tl.float64))).to(tl.float32)
    bits = r.to(tl.int32, bitcast=True)
    k = (bits >> 23) - 127  # r is a normal positive float32 for every finite amax
    ulps_below = 0x800000 - (bits & 0x7FFFFF)
    w = tl.where(k >= 0, k, -(k + 1))
    e = tl.maximum((w.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127, 0)  # floor(log2 w), w >= 1
    window = tl.where(w > 0, (_LN2_Q24 << e) >> 24, 0)
    s = k + (ulps_below <= window).to(tl.int32)
    # amax inf gives r = 0 (torch: scale 0, its reciprocal inf); a NaN amax gives NaN scales (r's bits).
    qbits = tl.where(r > 0, (s + 127) << 23, tl.where(r == 0, 0, bits))
    dbits = tl.where(r > 0, (127 - s) << 23, tl.where(r == 0, 0x7F800000, bits))
    qscale = qbits.to(tl.float32, bitcast=True)
    dscale = dbits.to(tl.float32, bitcast=True)
    return qscale, dscale


@triton.jit
def _to_fp8(y, q_ty, FMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr,
            SOFTWARE: tl.constexpr):
    """float32 ``y`` clamped to +-FMAX and rounded to nearest even: fp8 ``q_ty``, or its bytes (SOFTWARE).
    SUB = 2^(BIAS - 1 + MANT), the reciprocal of the smallest subnormal."""
    y = tl.minimum(tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX, propagate_nan=tl.PropagateNan.ALL)
    if SOFTWARE:
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        # normal: drop the low 23 - MANT mantissa bits, ties to even; a carry rolls into the exponent as it should
        normal = ((mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)) >> (23 - MANT)) - ((127 - BIAS) << MANT)
        # subnormal (below 2^(1 - BIAS)): a multiple of 2^(1 - BIAS - MANT), rounded to even by the 2^23 trick
        units = tl.minimum(tl.abs(y) * SUB, 16.0)  # only values below 2^MANT <= 8 take this branch
        sub = ((units + 8388608.0) - 8388608.0).to(tl.int32)
        code = tl.where(mag < ((128 - BIAS) << 23), sub, normal)
        code = tl.where(y != y, 0x7F, code) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8)
    return y.to(q_ty)


@triton.jit
def _cast_kernel(
    x_ptr, q_ptr, s_ptr, amax_ptr, R, C,
    sx_l, sx_r, sx_c, sq_l, sq_r, sq_c, ss_l, ss_r, ss_c,
    FMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr, SOFTWARE: tl.constexpr,
    MODE: tl.constexpr, STORE_QSCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    AMAX_ROWS: tl.constexpr = False,
):
    pid_r, pid_c, lead = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x_rows = x_ptr + lead * sx_l + rows.to(tl.int64)[:, None] * sx_r
    q_rows = q_ptr + lead * sq_l + rows.to(tl.int64)[:, None] * sq_r
    if MODE == 2:  # _ROW: one scale per row over every chunk of it; the strip is read twice
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (cols < C)[None, :]
            x = tl.load(x_rows + cols.to(tl.int64)[None, :] * sx_c, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        qscale, dscale = _scales(amax, FMAX)
        tl.store(s_ptr + lead * ss_l + rows.to(tl.int64) * ss_r, dscale, mask=row_ok)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (cols < C)[None, :]
            x = tl.load(x_rows + cols.to(tl.int64)[None, :] * sx_c, mask=mask, other=0.0).to(tl.float32)
            q = _to_fp8(x * qscale[:, None], q_ptr.dtype.element_ty, FMAX, MANT, BIAS, SUB, SOFTWARE)
            tl.store(q_rows + cols.to(tl.int64)[None, :] * sq_c, q, mask=mask)
    else:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_rows + cols.to(tl.int64)[None, :] * sx_c, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:  # _TILE: one scale per row of this 128-column tile
            qscale, dscale = _scales(tl.max(tl.abs(x), axis=1), FMAX)
            tl.store(s_ptr + lead * ss_l + rows.to(tl.int64) * ss_r + pid_c * ss_c, dscale, mask=row_ok)
            q = _to_fp8(x * qscale[:, None], q_ptr.dtype.element_ty, FMAX, MANT, BIAS, SUB, SOFTWARE)
        elif AMAX_ROWS:  # _GIVEN per row: each row's amax from memory (a TP shard's x^T, channels' amaxes)
            qscale, dscale = _scales(tl.load(amax_ptr + lead * R + rows, mask=row_ok, other=0.0), FMAX)
            if STORE_QSCALE:
                dscale = qscale
            if pid_c == 0:
                tl.store(s_ptr + lead * ss_l + rows.to(tl.int64) * ss_r, dscale, mask=row_ok)
            q = _to_fp8(x * qscale[:, None], q_ptr.dtype.element_ty, FMAX, MANT, BIAS, SUB, SOFTWARE)
        else:  # _BLOCK (this tile's amax) or _GIVEN (the stacked tensor's amax, from memory)
            if MODE == 1:
                amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            else:
                amax = tl.load(amax_ptr + lead)
            qscale, dscale = _scales(amax, FMAX)
            if STORE_QSCALE:  # cast_with_amax returns the quantisation factor, as torchao's cast does
                dscale = qscale
            if MODE == 1:
                tl.store(s_ptr + lead * ss_l + pid_r * ss_r + pid_c * ss_c, dscale)
            elif (pid_r == 0) & (pid_c == 0):  # one scale for the whole tensor: the first program writes it
                tl.store(s_ptr + lead * ss_l, dscale)
            q = _to_fp8(x * qscale, q_ptr.dtype.element_ty, FMAX, MANT, BIAS, SUB, SOFTWARE)
        tl.store(q_rows + cols.to(tl.int64)[None, :] * sq_c, q, mask=mask)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, R, C, sx_l, sx_r, sx_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """amax_ptr[lead] = max(amax_ptr[lead], this tile's max |x|); amax_ptr starts at 0."""
    lead = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + lead * sx_l + rows.to(tl.int64)[:, None] * sx_r + cols.to(tl.int64)[None, :] * sx_c,
                mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + lead, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit(do_not_specialize=["M"])
def _cast_token_tiles_kernel(
    x_ptr, q_ptr, s_ptr, sizes_ptr, M, C, G, sx_r, sx_c, sq_r, sq_c, ss_t, ss_c,
    FMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr, SOFTWARE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """Token tile t (numbered over the experts as ``quantize.group_token_tiles`` numbers them) x a column
    chunk: one scale per column over the tile's tokens. A tile past the last real one has no rows: its
    scales are those of amax 0, as the reference's."""
    t, pid_c = tl.program_id(0), tl.program_id(1)
    _, _, row_start, rows_left = _group_of_tile(sizes_ptr, G, M, t, TILE, BLOCK_G)
    offs = tl.arange(0, TILE)
    rows = (row_start + offs).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mask = (offs < rows_left)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx_r + cols.to(tl.int64)[None, :] * sx_c, mask=mask, other=0.0)
    x = x.to(tl.float32)
    qscale, dscale = _scales(tl.max(tl.abs(x), axis=0), FMAX)
    tl.store(s_ptr + t.to(tl.int64) * ss_t + cols * ss_c, dscale, mask=col_ok)
    q = _to_fp8(x * qscale[None, :], q_ptr.dtype.element_ty, FMAX, MANT, BIAS, SUB, SOFTWARE)
    tl.store(q_ptr + rows[:, None] * sq_r + cols.to(tl.int64)[None, :] * sq_c, q, mask=mask)


# -- launchers (inputs checked by quantize.py, which dispatches here) --------------------------------
def _format(dtype: torch.dtype) -> dict:
    """The constexprs of an fp8 dtype: its largest finite value, mantissa bits, exponent bias."""
    if dtype == torch.float8_e4m3fn:
        return {"FMAX": 448.0, "MANT": 3, "BIAS": 7, "SUB": 2.0**9}
    if dtype == torch.float8_e5m2:
        return {"FMAX": 57344.0, "MANT": 2, "BIAS": 15, "SUB": 2.0**16}
    raise ValueError(f"FP8 cast: dtype {dtype} is not float8_e4m3fn or float8_e5m2")


def _stacked(x: torch.Tensor) -> torch.Tensor:
    """x [..., R, C] as [L, R, C] (a view where the strides allow)."""
    return x.unsqueeze(0) if x.dim() == 2 else x.reshape(-1, *x.shape[-2:])


def _store_target(q: torch.Tensor) -> torch.Tensor:
    """What the kernels store into: q itself, or its bytes under the interpreter (SOFTWARE cast)."""
    return q.view(torch.uint8) if triton_interpreting() else q


def _launch_cast(x3, q3, s3, amax, mode: int, dtype, store_qscale: bool = False, amax_rows: bool = False) -> None:
    lead, rows, cols = x3.shape
    block_r = {_BLOCK: WEIGHT_BLOCK, _ROW: ROW_STRIP}.get(mode, TILE_R)
    grid = (triton.cdiv(rows, block_r), 1 if mode == _ROW else triton.cdiv(cols, TILE_C), lead)
    _cast_kernel[grid](
        x3, _store_target(q3), s3, amax if amax is not None else s3, rows, cols,
        *x3.stride(), *q3.stride(), *s3.stride(),
        **_format(dtype), SOFTWARE=triton_interpreting(), MODE=mode, STORE_QSCALE=store_qscale,
        BLOCK_R=block_r, BLOCK_C=TILE_C, num_warps=8 if mode == _BLOCK else 4, AMAX_ROWS=amax_rows,
    )


def tensor_amax(x3: torch.Tensor) -> torch.Tensor:
    """[L] float32: max |x| of each stacked [R, C] tensor, on the device (a zero fill, then one kernel)."""
    lead, rows, cols = x3.shape
    amax = torch.zeros(lead, dtype=torch.float32, device=x3.device)
    grid = (triton.cdiv(rows, TILE_R), triton.cdiv(cols, TILE_C), lead)
    _amax_kernel[grid](x3, amax, rows, cols, *x3.stride(), BLOCK_R=TILE_R, BLOCK_C=TILE_C, num_warps=4)
    return amax


def quantize_blocks_triton(x: torch.Tensor, block_rows: int | None, block_cols: int | None,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize.quantize_blocks`` for the recipes' blocks: (None, None), (1, None), (1, 128), (128, 128)."""
    *lead_shape, rows, cols = x.shape
    x3 = _stacked(x)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    q3 = _stacked(q)
    if (block_rows, block_cols) == (None, None):
        s3 = torch.empty(x3.shape[0], 1, 1, dtype=torch.float32, device=x.device)
        mode, amax = _GIVEN, tensor_amax(x3) if x.numel() else None
    elif (block_rows, block_cols) == (1, None):
        s3 = torch.empty(x3.shape[0], rows, 1, dtype=torch.float32, device=x.device)
        mode, amax = (_TILE if cols <= TILE_C else _ROW), None
    elif (block_rows, block_cols) in ((1, WEIGHT_BLOCK), (WEIGHT_BLOCK, WEIGHT_BLOCK)):
        nr = rows if block_rows == 1 else triton.cdiv(rows, WEIGHT_BLOCK)
        s3 = torch.empty(x3.shape[0], nr, triton.cdiv(cols, WEIGHT_BLOCK), dtype=torch.float32, device=x.device)
        mode, amax = (_TILE if block_rows == 1 else _BLOCK), None
    else:
        raise ValueError(f"quantize_blocks_triton: blocks {(block_rows, block_cols)} are no recipe's; "
                         "use (None, None), (1, None), (1, 128) or (128, 128)")
    if x.numel():
        _launch_cast(x3, q3, s3, amax, mode, dtype)
    return q, s3.view(*lead_shape, *s3.shape[1:])


def cast_with_amax_triton(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize.cast_with_amax`` for a non-empty 2-D x [R, C] and a one-element amax, or one per row
    ([R, 1]): (q, quantisation scale shaped as amax)."""
    rows = amax.numel() > 1
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    qscale = torch.empty(1, x.shape[0] if rows else 1, 1, dtype=torch.float32, device=x.device)
    _launch_cast(_stacked(x), _stacked(q), qscale, amax.reshape(-1).float(), _GIVEN, dtype, store_qscale=True,
                 amax_rows=rows)
    return q, qscale.view(amax.shape)


def quantize_token_tiles_triton(x: torch.Tensor, group_sizes: torch.Tensor, num_tiles: int, dtype: torch.dtype
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize.quantize_token_tiles``: x [M, C] -> (q [M, C], scale [num_tiles, C])."""
    m, cols = x.shape
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(num_tiles, cols, dtype=torch.float32, device=x.device)
    if scale.numel():
        groups = group_sizes.numel()
        _cast_token_tiles_kernel[(num_tiles, triton.cdiv(cols, TOKEN_COLS))](
            x, _store_target(q), scale, group_sizes, m, cols, groups,
            *x.stride(), *q.stride(), *scale.stride(),
            **_format(dtype), SOFTWARE=triton_interpreting(), TILE=TOKEN_TILE, BLOCK_C=TOKEN_COLS,
            BLOCK_G=_block_g(groups), num_warps=8,
        )
    return q, scale
