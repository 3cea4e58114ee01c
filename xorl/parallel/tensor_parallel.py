"""The tensor-parallel plan: lay an xorl causal LM (xorl/models) out over the TP ranks by its TP layout.

    record = apply_tensor_parallel(model, tp_mesh, sequence_parallel=True, overlap=True)

The layout is data declared beside the model (xorl/models/tp_layout.py: module path -> style); the
styles are xorl/nn/tp_styles.py (column, row, heads, replicated, per-head replicated, width norm, the
heads' shared RoPE key, MoE on token shards, the vocabulary ends). This function only walks it: for
each path the model has, it calls the style, and puts the module the style returns in the old one's
place with ``nn.Module.set_submodule(path, module, strict=True)`` (torch's own method, which replaces
only a submodule that exists); a style that keeps the module changes it through the module's explicit
methods (``MoE.run_on_token_shards``) or ``put_params_on_tp`` (xorl/nn/tp_replicated.py). Then the
layout's shared-input column groups gather their input once, and every parameter must be placed.

Sequence parallel (SP) region = from the embedding's output to the lm_head's input: the
vocabulary-parallel embedding reduce-scatters into this rank's sequence shard, the decoder layers
and the final norm run on the shard, and the lm_head gathers the sequence as any column layer
does. Under pipelining the activations between stages are therefore sequence shards. Inside the
region the norms and residual adds run on the shard; the column layers all-gather along the
sequence, the row layers reduce-scatter along it. Replicated parameters used inside the region on
a shard of the data have partial gradients: the decoder and final norms under SP, per-head q/k
norms always (each rank normalises only its own heads). They are listed in the returned record's
``partial_grads``, and the step sums them over TP once per optimizer step
(``xorl.nn.tp_replicated.sum_tp_partial_grads``: one all-reduce; xorl/parallel/step_plan.py's StepPlan).

MoE models: attention is tensor-parallel, and each MoE block runs on this TP rank's token shard,
its experts split over the TP ranks by expert parallelism (EP folds over dp_shard x CP x TP, see
xorl/distributed/parallel_config.py): no TP rank computes another's tokens. Under SP the block's
input already is the rank's sequence shard; without SP it keeps its chunk of the replicated
sequence and gathers the outputs again. The router and shared-expert parameters then see a
share of the tokens on each TP rank: their gradients are listed with the partial ones.

Communication record: ``xorl.nn.tp_comm.overlap_report(model)`` after a step, keyed by module path:
``model.layers.{i}.self_attn.qkv_proj`` / ``.o_proj`` and ``model.layers.{i}.mlp.gate_up_proj`` /
``.down_proj`` (shared-input groups report under the group's name), and OLMoE's
``model.layers.{i}.self_attn.q_norm`` / ``.k_norm`` (one all-reduce forward, one backward).

Requirements: query and KV head counts divisible by TP,
intermediate size divisible by TP, every rank holding the same full weights before the call
(same seed or the same checkpoint), and under SP every sequence length divisible by TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

from xorl.models.decoder import DecoderForCausalLM
from xorl.models.tp_layout import TPLayout, decoder_tp_layout
from xorl.nn.tp_comm import DEFAULT_OVERLAP_MIN_NUMEL, TPGroup
from xorl.nn.tp_linear import SharedInputColumnGroup
from xorl.nn.tp_replicated import TPPartialGrads
from xorl.nn.tp_styles import TP_STYLES, StyleContext


@dataclass
class TensorParallelRecord:
    """What ``apply_tensor_parallel`` did, for the step (xorl/parallel/step_plan.py's StepPlan)."""

    tp: TPGroup
    sequence_parallel: bool  # activations between layers (and pipeline stages) are sequence shards
    partial_grads: TPPartialGrads  # replicated parameters whose gradients the step sums over TP
    moe_on_token_shards: bool  # MoE blocks route this rank's tokens: router losses differ per TP rank

    @property
    def sequence_shards(self) -> int:
        """Into how many shards a rank's sequence is split between layers (1 without SP)."""
        return self.tp.size if self.sequence_parallel else 1


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True, overlap: bool = True, *,
                          overlap_min_numel: int = DEFAULT_OVERLAP_MIN_NUMEL, share_gathered_inputs: bool = True,
                          layout: TPLayout | None = None) -> TensorParallelRecord:
    """Lay ``model`` out over the 1-D ``tp_mesh`` in place by ``layout`` (default: the decoder's, from
    ``model.spec``); returns what was done. TP size 1: unchanged."""
    tp = TPGroup.from_mesh(tp_mesh)
    partial = TPPartialGrads(tp)
    if tp.size == 1:
        return TensorParallelRecord(tp, False, partial, False)
    if layout is None:
        if not isinstance(model, DecoderForCausalLM):
            raise ValueError(
                "apply_tensor_parallel expects an HF-style causal LM built by xorl.models (its TP layout: "
                f"xorl/models/tp_layout.py), or a layout; got {type(model).__name__}"
            )
        layout = decoder_tp_layout(model.spec)
    ctx = StyleContext(tp_mesh, tp, bool(sequence_parallel), bool(overlap), int(overlap_min_numel), partial)
    for path, style in layout.styles.items():
        module = _module_at(model, path)
        if module is None:
            continue
        if style not in TP_STYLES:
            raise ValueError(f"TP layout: {path} has the style {style!r}; the styles are {sorted(TP_STYLES)}")
        replacement = TP_STYLES[style](module, path, ctx)
        if replacement is not None:
            model.set_submodule(path, replacement, strict=True)
    if share_gathered_inputs:
        for name, members in layout.shared_inputs.items():
            layers = [_module_at(model, member) for member in members]
            if all(layer is not None for layer in layers):
                SharedInputColumnGroup(layers, name=name)
    _check_every_parameter_placed(model, ctx.plain)
    return TensorParallelRecord(tp, ctx.sequence_parallel, partial, bool(ctx.plain))


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path``, or None where the model has none there (a form the layout also lists,
    or what another pipeline stage holds)."""
    module = model
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    if not isinstance(module, nn.Module):
        raise TypeError(f"TP layout: {path} is a {type(module).__name__}, not a module")
    return module


def _check_every_parameter_placed(model: nn.Module, plain: list[str]) -> None:
    """Every parameter outside the blocks left plain (MoE on token shards) must now be a DTensor on the
    TP mesh: a module the layout does not name fails here, not in a run."""
    missing = [n for n, p in model.named_parameters()
               if not isinstance(p, DTensor) and not any(n.startswith(f"{path}.") for path in plain)]
    if missing:
        raise ValueError(
            f"apply_tensor_parallel does not know how to place these parameters: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; give their modules a style in the TP layout "
            "(xorl/models/tp_layout.py)"
        )
