"""gpt-oss expert weights from HF files: MXFP4 dequantisation and the interleaved gate / up layout.

The released gpt-oss checkpoints store each expert projection as MXFP4 (the OCP microscaling
format): ``{proj}_blocks`` uint8 [E, out, in / 32, 16], two fp4 (e2m1) values per byte (low nibble
first), and ``{proj}_scales`` uint8 [E, out, in / 32], one power-of-two exponent per 32 values
(e8m0, bias 127). ``dequantize_mxfp4`` matches transformers' ``convert_moe_packed_tensors``
(transformers/integrations/mxfp4.py: the same lookup table, nibble order and ldexp), without its
final transpose. A bf16 gpt-oss folder (transformers' save_pretrained) holds ``{proj}`` [E, in, out]
instead. Either way the gate_up projection's out columns interleave gate and up (``[..., ::2]`` gate,
``[..., 1::2]`` up), and xorl holds gate units then up units (xorl/nn/moe_experts.py).

``ExpertRecipe`` reads the box a rank holds (its experts, and of those only the in rows and out
columns its shard covers; for MXFP4 the 32-value blocks around them) and converts it on the way, so
no rank dequantises more than its own shards (hf_reader's loading path calls it like its own recipes).
"""

from __future__ import annotations

import re

import torch

# e2m1 values of the 16 nibbles (sign bit 3, exponent bits 2-1, mantissa bit 0), as transformers' FP4_VALUES.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127

EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in ``dtype``: value 2i of a
    block is the low nibble of byte i, 2i + 1 the high one, each times 2 ** (scale - 127)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1), out=out)
    return out.flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]):
    per 32 values the exponent that brings the largest magnitude to at most 6, each value rounded to
    the nearest e2m1 value. For tests and small conversions (it holds the whole tensor)."""
    *lead, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dim ({k}) must be a multiple of {BLOCK}")
    w = weight.float().reshape(*lead, k // BLOCK, BLOCK)
    amax = w.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = w / torch.exp2(exp).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    nibble = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1) | ((scaled < 0).long() << 3)
    byte = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    return byte, (exp + SCALE_BIAS).to(torch.uint8)


class ExpertRecipe:
    """One xorl expert tensor of a gpt-oss layer from its HF file tensors (hf_layout's recipe protocol:
    ``sources``, ``shape(shapes)``, ``fill(read, dest, box)``).

    xorl tensors: ``gate_up_proj`` [E, H, 2I] and ``gate_up_proj_bias`` [E, 2I] (gate units, then up),
    ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]."""

    def __init__(self, prefix: str, proj: str, bias: bool, sources: set[str]):
        self.interleaved = proj == "gate_up_proj"
        self.bias = bias
        self.quantized = not bias and f"{prefix}.{proj}_blocks" in sources
        if bias:
            self.sources = [f"{prefix}.{proj}_bias"]
        elif self.quantized:
            self.sources = [f"{prefix}.{proj}_blocks", f"{prefix}.{proj}_scales"]
        else:
            self.sources = [f"{prefix}.{proj}"]

    def shape(self, shapes):
        if self.quantized:
            experts, out_features, groups, pair = shapes[self.sources[0]]
            return (experts, groups * pair * 2, out_features)
        return shapes[self.sources[0]]

    def _read(self, read, experts: slice, rows: slice | None, cols: slice) -> torch.Tensor:
        """File columns ``cols`` (out features) of ``experts`` (and in rows ``rows``): [e, (in,) out]."""
        if self.bias:
            return read(self.sources[0], (experts, cols))
        if not self.quantized:
            return read(self.sources[0], (experts, rows, cols))
        first, last = rows.start // BLOCK, -(-rows.stop // BLOCK)  # the 32-value blocks around the rows
        blocks = read(self.sources[0], (experts, cols, slice(first, last)))
        scales = read(self.sources[1], (experts, cols, slice(first, last)))
        values = dequantize_mxfp4(blocks, scales, torch.float32)  # [e, out, in]: exact in fp32
        return values[..., rows.start - first * BLOCK:rows.stop - first * BLOCK].transpose(1, 2)

    def fill(self, read, dest, box):
        experts, *rest = box.slices
        rows = rest[0] if len(rest) == 2 else None
        cols = rest[-1]
        if not self.interleaved:
            dest.copy_(self._read(read, experts, rows, cols))
            return
        units = box.global_shape[-1] // 2
        # (xorl column range, its unit range, parity): xorl column shift + u is file column 2u + parity.
        parts = [(lo, hi, lo - shift, hi - shift, parity) for parity, shift in ((0, 0), (1, units))
                 if (lo := max(cols.start, shift)) < (hi := min(cols.stop, shift + units))]
        if len(parts) == 2 and max(parts[0][2], parts[1][2]) < min(parts[0][3], parts[1][3]):
            # Gate and up units overlap (a box of whole experts: the same units): one read serves both.
            first, last = min(parts[0][2], parts[1][2]), max(parts[0][3], parts[1][3])
            both = self._read(read, experts, rows, slice(2 * first, 2 * last))
            for lo, hi, u_lo, u_hi, parity in parts:
                picked = both[..., 2 * (u_lo - first) + parity:2 * (u_hi - first):2]
                dest[..., lo - cols.start:hi - cols.start].copy_(picked)
            return
        for lo, hi, u_lo, u_hi, parity in parts:
            part = self._read(read, experts, rows, slice(2 * u_lo + parity, 2 * u_hi + parity - 1))
            dest[..., lo - cols.start:hi - cols.start].copy_(part[..., ::2])


def interleave_gate_up(tensor: torch.Tensor) -> torch.Tensor:
    """xorl's [..., gate units | up units] -> the HF file's [..., g0, u0, g1, u1, ...] (export)."""
    gate, up = tensor.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)
