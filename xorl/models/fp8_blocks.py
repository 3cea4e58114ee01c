"""Block-quantised FP8 checkpoints (DeepSeek-V3 / R1 / Kimi-K2 as released): dequantised on load.

Such a folder's config.json says ``quantization_config: {quant_method: fp8, weight_block_size:
[128, 128], ...}``, and each quantised ``X.weight`` (float8 e4m3, [out, in]) has beside it
``X.weight_scale_inv`` (fp32, [ceil(out / 128), ceil(in / 128)]): the weight is ``fp8 x scale`` of
its 128 x 128 block (transformers' FineGrainedFP8 ``dequantize``). The loader (xorl/models/hf_reader.py)
reads any box of such a weight through :func:`dequantize_box`: only the box's fp8 elements and the
scales of the blocks it touches are read, so a rank never holds more of the file than its shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

SCALE_SUFFIX = "_scale_inv"


def block_size(folder: str) -> tuple[int, int] | None:
    """The folder's FP8 weight block (rows, cols), or None when config.json declares no fp8 quantisation."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    if quant.get("quant_method") != "fp8":
        return None
    rows, cols = quant.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def dequantize_box(read: Callable[[str, tuple], torch.Tensor], key: str, scale_key: str,
                   index: tuple[slice, ...], shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """fp32 box ``index`` of the 2-D fp8 weight ``key`` (global ``shape``) times its block scales.

    ``read(name, index)`` reads a box of a stored tensor. Only unit-step slices occur in the loader's
    recipes."""
    bounds = []
    for s, size in zip(index, shape):
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"{key}: an FP8 block-quantised weight is read in unit-step boxes only")
        bounds.append((start, stop))
    (r0, r1), (c0, c1) = bounds
    values = read(key, (slice(r0, r1), slice(c0, c1))).float()
    if values.numel() == 0:
        return values
    (br, bc) = block
    scales = read(scale_key, (slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc)))).float()
    scales = scales.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return values * scales[r0 - r0 // br * br:][: r1 - r0, c0 - c0 // bc * bc:][:, : c1 - c0]
