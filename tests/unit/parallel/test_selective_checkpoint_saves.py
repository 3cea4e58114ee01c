"""Selective checkpointing's save list: each custom op joins it where it is defined, and a name
that is not a registered op is an error rather than silently skipped."""

import pytest
import torch

import xorl.nn.ep_dispatch  # noqa: F401  (defines the EP ops)
import xorl.nn.ring_attention  # noqa: F401
import xorl.nn.tp_linear_ops  # noqa: F401  (the TP linears)
import xorl.nn.tp_regions  # noqa: F401  (the TP collectives)
import xorl.nn.ulysses_attention  # noqa: F401
import xorl_kernels.fp8.grouped  # noqa: F401  (the FP8 GEMMs)
import xorl_kernels.fp8.linear  # noqa: F401
from xorl_kernels.selective_checkpoint_saves import SELECTIVE_CHECKPOINT_SAVES, OpRegistry


def test_the_attention_expert_and_collective_ops_are_saved():
    names = set(SELECTIVE_CHECKPOINT_SAVES.names())
    assert names == {f"xorl::{n}" for n in ("flash_attn", "grouped_gemm", "grouped_gemm_bias", "ring_attention",
                                             "ulysses_seq_to_head",
                                             "ulysses_head_to_seq", "ep_all_to_all", "ep_exchange_counts",
                                             "tp_all_gather", "tp_reduce_scatter", "tp_all_reduce",
                                             "tp_column_linear", "tp_row_linear", "fp8_linear",
                                             "fp8_grouped_gemm", "gated_delta_rule")}
    ops = SELECTIVE_CHECKPOINT_SAVES.ops()
    assert torch.ops.xorl.ring_attention.default in ops and torch.ops.xorl.grouped_gemm.default in ops
    assert len(ops) == len(names)


def test_an_fp8_linear_counts_as_one_dense_matmul_and_grouped_gemms_as_none():
    # selective_checkpoint: every_other_matmul counts an FP8 linear as the mm / addmm a bf16 one runs;
    # the experts' grouped GEMMs (bf16 or FP8) are always kept, counted as no dense matmul.
    x, w = torch.randn(2, 5, 8), torch.randn(6, 8)
    assert SELECTIVE_CHECKPOINT_SAVES.dense_matmuls(torch.ops.xorl.fp8_linear.default, (x, w, None, "rowwise")) == 1
    assert SELECTIVE_CHECKPOINT_SAVES.dense_matmuls(torch.ops.xorl.fp8_grouped_gemm.default, ()) == 0


def test_an_unknown_op_is_an_error_not_skipped():
    registry = OpRegistry()
    registry.join("xorl::flash_attn")
    registry.join("xorl::flash_atn")
    with pytest.raises(RuntimeError, match=r"not registered: \['xorl::flash_atn'\]"):
        registry.ops()
    with pytest.raises(ValueError, match="namespace::name"):
        registry.join("flash_attn")


def test_the_checkpointing_plan_saves_the_registered_ops():
    from xorl.parallel.activation_checkpointing import _save_ops

    assert SELECTIVE_CHECKPOINT_SAVES.ops() <= _save_ops()


@pytest.mark.slow  # starts processes (fresh interpreters): the full suite's, not the quick tier's
def test_the_save_list_does_not_depend_on_what_was_imported_first():
    # A fresh interpreter that imports only the checkpointing plan: every op module is brought in
    # by _save_ops itself (else a TP or EP op imported later would be silently recomputed).
    import subprocess
    import sys

    code = ("from xorl.parallel.activation_checkpointing import _save_ops; ops = _save_ops(); "
            "print(sorted(str(o) for o in ops if str(o).startswith('xorl.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "xorl.tp_column_linear.default" in out and "xorl.ep_all_to_all.default" in out, out
    assert "xorl.fp8_linear.default" in out and "xorl.fp8_grouped_gemm.default" in out, out
