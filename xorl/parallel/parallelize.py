"""Apply TP, CP, EP, activation checkpointing, torch.compile and FSDP2 to a model, in that order.

Read top to bottom, torchtitan-style: each step is one call into the plan that owns it
(xorl/parallel/*), and each step only sees the model the previous one left. FSDP2 comes last so it
shards the parameters the other plans created (DTensors on the TP mesh, expert shards on the EP
mesh) on the data-parallel dims. Pipeline parallelism splits the model into stages before this
(xorl/parallel/pipeline_parallel.py); each stage is then parallelised here.

Every plan returns a record of what it did; ``build_step_plan`` keeps them in one
``StepPlan`` (xorl/parallel/step_plan.py), which answers the training step's questions (what to
reduce after backward, the batch multiples, the shapes between stages), so the step itself names
no parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from xorl.config import compute_dtype
from xorl.distributed.parallel_config import fsdp_reshards_after_forward
from xorl.parallel.activation_checkpointing import (
    ActivationCheckpointingRecord,
    apply_activation_checkpointing,
    checkpointing_mode,
)
from xorl.parallel.compile import CompileRecord, apply_compile
from xorl.parallel.data_parallel import FSDPRecord, apply_fsdp
from xorl.parallel.step_plan import StepPlan


@dataclass
class ModelPart:
    """One model part (the model, or one pipeline stage) and the records of the plans applied to it."""

    module: nn.Module
    tensor: object | None = None  # xorl.parallel.tensor_parallel.TensorParallelRecord
    context: object | None = None  # xorl.parallel.context_parallel.ContextParallelRecord
    expert: object | None = None  # xorl.parallel.expert_parallel.ExpertParallelRecord
    router_balance: object | None = None  # xorl.parallel.expert_parallel.RouterBalanceRecord
    checkpointing: ActivationCheckpointingRecord | None = None
    compiled: CompileRecord | None = None
    fsdp: FSDPRecord | None = None


def build_step_plan(model: nn.Module, state, config) -> StepPlan:
    """Split ``model`` into this rank's pipeline stages (if any), parallelise each, and keep what was done."""
    pipeline = None
    modules = [model]
    if state.pp_size > 1:
        from xorl.parallel.pipeline_parallel import split_into_stages

        pipeline = split_into_stages(model, state, config)
        modules = pipeline.stages
    parts = [parallelize_model(module, state, config) for module in modules]
    return StepPlan(state, config, parts, pipeline)


def parallelize_model(model: nn.Module, state, config) -> ModelPart:
    train = config.train
    part = ModelPart(model)
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


