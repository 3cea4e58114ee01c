"""Apply TP, CP, EP, activation checkpointing, torch.compile and FSDP2 to a model, in that order.

Read top to bottom, torchtitan-style: each step is one call into the plan that owns it
(xorl/parallel/*), and each step only sees the model the previous one left. FSDP2 comes last so it
shards the parameters the other plans created (DTensors on the TP mesh, expert shards on the EP
mesh) on the data-parallel dims. Pipeline parallelism splits the model into stages before this
(xorl/parallel/pipeline_parallel.py); each stage is then parallelised here.

Every plan returns a record of what it did; ``build_parallel_plan`` keeps them in one
``ParallelPlan`` (xorl/parallel/step_plan.py), which answers the training step's questions (what to
reduce after backward, the batch multiples, the shapes between stages), so the step itself names
no parallelism.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from xorl.config import compute_dtype
from xorl.distributed.parallel_config import fsdp_reshards_after_forward
from xorl.parallel.data_parallel import (
    CheckpointingRecord,
    FSDPRecord,
    apply_activation_checkpointing,
    apply_fsdp,
    checkpointing_mode,
)
from xorl.parallel.step_plan import ParallelPlan


@dataclass
class PartPlan:
    """One model part (the model, or one pipeline stage) and the records of the plans applied to it."""

    module: nn.Module
    tensor: object | None = None  # xorl.parallel.tensor_parallel.TensorParallelRecord
    context: object | None = None  # xorl.parallel.context_parallel.ContextParallelRecord
    expert: object | None = None  # xorl.parallel.expert_parallel.ExpertParallelRecord
    router_balance: object | None = None  # xorl.parallel.expert_parallel.RouterBalanceRecord
    checkpointing: CheckpointingRecord | None = None
    compiled: CompileRecord | None = None
    fsdp: FSDPRecord | None = None


def build_parallel_plan(model: nn.Module, state, config) -> ParallelPlan:
    """Split ``model`` into this rank's pipeline stages (if any), parallelise each, and keep what was done."""
    pipeline = None
    modules = [model]
    if state.pp_size > 1:
        from xorl.parallel.pipeline_parallel import split_into_stages

        pipeline = split_into_stages(model, state, config)
        modules = pipeline.stages
    parts = [parallelize_model(module, state, config) for module in modules]
    return ParallelPlan(state, config, parts, pipeline)


def parallelize_model(model: nn.Module, state, config) -> PartPlan:
    train = config.train
    part = PartPlan(model)
    if state.tp_size > 1:
        from xorl.parallel.tensor_parallel import apply_tensor_parallel

        part.tensor = apply_tensor_parallel(model, state.tp_mesh, sequence_parallel=train.sequence_parallel,
                                            overlap=train.tp_overlap)
    if state.cp_size > 1:
        from xorl.nn.attention_backends import attention_backend
        from xorl.parallel.context_parallel import apply_context_parallel

        part.context = apply_context_parallel(
            model, ring_group=state.ring_group, ulysses_group=state.ulysses_group,
            attn_backend=attention_backend(config.model.attn_implementation).ring_step)
    if getattr(config.model, "num_experts", 0):
        from xorl.parallel.expert_parallel import apply_expert_parallel, set_router_balance_group

        if state.ep_size > 1:
            # The EP mesh (not just its group): expert weights become DTensors of global shape
            # [E, ...] sharded over "ep", so checkpoints and norms see every expert exactly once.
            part.expert = apply_expert_parallel(model, state.ep_mesh)
        # Load balancing over the whole microbatch (its CP shards and, as MoE blocks run on token
        # shards under TP, its TP shards), or Qwen's global batch (every data rank's too).
        part.router_balance = set_router_balance_group(model, router_balance_group(state, config))
    mode = checkpointing_mode(train.activation_checkpointing)
    if mode != "none":
        part.checkpointing = apply_activation_checkpointing(model, mode, train.activation_checkpointing_every_n_layers,
                                                            train.selective_checkpoint)
    if train.compile:
        # Layouts whose blocks cannot compile whole (experts an FSDP unit of their own inside each
        # block) are refused before start-up: xorl/config/rules/train.py compile_problems.
        part.compiled = apply_compile(model, "inductor" if train.compile is True else train.compile,
                                      capture_scalar_outputs=state.ep_size > 1)
    if train.data_parallel_mode == "fsdp2":
        bf16 = compute_dtype(train, "cuda" if torch.cuda.is_available() else "cpu") == "bfloat16"
        part.fsdp = apply_fsdp(model, state, reshard_after_forward=fsdp_reshards_after_forward(train, state.pp_size),
                               bf16_compute=bf16, float8_all_gather=train.fp8_all_gather)
    return part


def router_balance_group(state, config):
    """The ranks whose tokens one router load-balancing statistic covers (model.router_balance_scope):
    the context- and tensor-parallel shards of one microbatch, or every data rank's too."""
    if config.model.router_balance_scope == "global_batch":
        return state.dp_cp_tp_group
    return state.cp_tp_group


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
    # undone within its own forward: TPReplicated swaps a module's local tensors into its parameter
    # slots and back (xorl/nn/tp_replicated.py); SharedInputColumnGroup keeps its members' outputs
    # until each has asked (xorl/nn/tensor_parallel.py). So they need no replay: the recompute is the
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
