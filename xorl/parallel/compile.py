"""``train.compile``: torch.compile per decoder block, and the check that no compiled block ran eager.

    record = apply_compile(model, backend)   # after activation checkpointing, before FSDP2
    check_compiled([record, ...])            # after the first step: CompileFellBackError if a block ran eager
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class CompileRecord:
    """What ``apply_compile`` did, and what the blocks did since: ``ran_eager`` collects the indices
    of compiled blocks whose forward ran as plain Python (dynamo made no graph for that call)."""

    backend: str
    layers: list[int]  # the compiled decoder blocks' indices
    ran_eager: set[int] = field(default_factory=set)


def apply_compile(model: nn.Module, backend: str = "inductor", capture_scalar_outputs: bool = False) -> CompileRecord:
    """torch.compile each decoder block's forward in place, as torchtitan's apply_compile does.

    Per block, not the whole model: every block has the same code, so one compilation serves them
    all (nothing a block's graph reads is specific to one layer: the TP linears' op key is one per
    TP group and settings, xorl/nn/tp_linear_ops.py), and FSDP's per-block hooks stay outside the
    graphs (they run in the module's __call__, which is not compiled; only ``forward`` is, which
    keeps parameter names unchanged). A checkpointed block compiles with its checkpoint wrapper,
    so selective checkpointing's policy is part of the graph.

    Never a silent slow path: ``fullgraph=True`` makes a graph break, and dynamo's recompile limit,
    an error; each block's forward also notes in the returned record when it runs outside a graph
    (dynamo disabled, its errors suppressed), which ``check_compiled`` turns into an error after
    the first step. ``capture_scalar_outputs``: expert parallelism reads its all_to_all split sizes
    on the host (the one sync of a step); dynamo then traces them as unbacked symbolic sizes
    instead of breaking the graph there.
    """
    if capture_scalar_outputs:
        torch._dynamo.config.capture_scalar_outputs = True
    # Inside an activation-checkpoint region dynamo refuses Python side effects, because eager
    # checkpointing replays them in the recompute and a compiled recompute cannot. A block's are
    # undone within its own forward: TPLocalTensors swaps a module's local tensors into its parameter
    # slots and back (xorl/nn/tp_replicated.py); SharedInputColumnGroup keeps its members' outputs
    # until each has asked (xorl/nn/tp_linear.py). So they need no replay: the recompute is the
    # traced graph. (Tensor state, the routers' load count, is traced as a graph mutation anyway.)
    # torchtitan's apply_compile sets the same.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layers = model.model.layers
    record = CompileRecord(backend, [i for i, layer in enumerate(layers) if layer is not None])
    for i in record.layers:
        layers[i].forward = torch.compile(_noting_eager_runs(layers[i].forward, record.ran_eager, i),
                                          backend=backend, fullgraph=True)
    return record


def _noting_eager_runs(forward, ran_eager: set[int], index: int):
    """``forward``, adding ``index`` to ``ran_eager`` whenever it runs as plain Python. Traced by
    dynamo, the test is False and the branch leaves no trace in the graph; a host-side set, no
    device work."""

    @functools.wraps(forward)
    def block_forward(*args, **kwargs):
        if not torch.compiler.is_compiling():
            ran_eager.add(index)
        return forward(*args, **kwargs)

    return block_forward


class CompileFellBackError(RuntimeError):
    """train.compile is on and a compiled decoder block ran eager."""


def check_compiled(records: list[CompileRecord]) -> None:
    """Raise CompileFellBackError if a compiled block ran eager (call after the first step)."""
    eager = sorted({i for r in records for i in r.ran_eager})
    if not eager:
        return
    from torch._dynamo.utils import counters

    dynamo = torch._dynamo.config
    reasons = [r.splitlines()[0] for r in counters["graph_break"]][:3]
    if dynamo.disable:
        reasons.insert(0, "dynamo is disabled (TORCHDYNAMO_DISABLE or torch._dynamo.config.disable)")
    if dynamo.suppress_errors:
        reasons.insert(0, "dynamo's errors are suppressed (TORCHDYNAMO_SUPPRESS_ERRORS), so a block it failed to "
                          "compile ran eager: unset it to see the error")
    why = "; ".join(reasons) or "unknown: rerun with TORCH_LOGS=graph_breaks,recompiles to see why"
    raise CompileFellBackError(
        f"train.compile={records[0].backend}: decoder blocks {eager} ran eager, outside any compiled graph, in the "
        f"first step ({why}); fix the cause, or set train.compile: false to train eager on purpose")
