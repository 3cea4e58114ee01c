"""The train.fp8 and train.fp8_all_gather rules (xorl_kernels/fp8, xorl/nn/fp8_all_gather.py)."""

from __future__ import annotations

from typing import Any


def fp8_problems(t: Any, m: Any, local: bool = True) -> list[str]:
    """train.fp8 (xorl_kernels/fp8): what it needs, and the combinations it does not cover.

    Every parallel layout composes: the FP8 GEMMs are local to each linear (TP shards quantise
    their own shards, the ring-overlapped TP paths each chunk), FSDP2 / HSDP gather the
    high-precision weights as before (or, with fp8_all_gather, their tensorwise float8 cast), and
    EP / PP / CP do not touch the linears' maths. train.compile composes too: the FP8 GEMMs are torch
    custom ops (xorl::fp8_linear, xorl::fp8_grouped_gemm, their backward ops), one node each in a
    compiled block's graph, the float8 all-gathered weight included (tests/multirank/test_compile_fp8.py)."""
    problems = _fp8_all_gather_problems(t) if t.fp8_all_gather else []
    if t.fp8 == "none":
        return problems
    import importlib.util

    if local and importlib.util.find_spec("torchao") is None:  # local: this machine (validate_config)
        problems.append(
            f"train.fp8: {t.fp8} quantises with torchao's float8 scaling helpers, and torchao is not installed; "
            "pip install torchao (the 'fp8' extra), or set fp8: none"
        )
    from xorl.models.families import MODEL_TYPES, family

    if t.fp8 == "blockwise" and m.model_type in MODEL_TYPES and family(m.model_type).expert_biases:
        problems.append(
            f"train.fp8: blockwise with model_type={m.model_type!r}: its experts add per-expert biases, and the "
            "FP8 grouped GEMM takes none; use fp8: rowwise or tensorwise (the experts then compute in train.dtype)"
        )
    return problems


def _fp8_all_gather_problems(t: Any) -> list[str]:
    """train.fp8_all_gather (xorl/nn/fp8_all_gather.py): FSDP2 gathers tensorwise-cast weights."""
    if t.fp8 != "tensorwise":
        return [
            f"train.fp8_all_gather: true with train.fp8: {t.fp8}: only tensorwise scaling can be all-gathered in "
            "float8 (each shard cast with the whole weight's one scale; per-row or per-block scales computed on "
            "a shard are not the whole weight's under every shard layout); set fp8: tensorwise, or "
            "fp8_all_gather: false"
        ]
    problems = []
    if t.data_parallel_mode != "fsdp2":
        problems.append(
            f"train.fp8_all_gather: true with data_parallel_mode: {t.data_parallel_mode}: the float8 all-gather is "
            "FSDP2's weight all-gather; set data_parallel_mode: fsdp2, or fp8_all_gather: false"
        )
    if t.tensor_parallel_size > 1:
        problems.append(
            "train.fp8_all_gather: true with tensor_parallel_size > 1: the TP linears run their own GEMMs on "
            "their local shards and take no float8-gathered weight; set fp8_all_gather: false (TP's linears "
            "then gather in train.dtype), or tensor_parallel_size: 1"
        )
    return problems
