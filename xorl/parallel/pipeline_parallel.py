"""Pipeline parallelism: cut the model into stages and run a torch.distributed.pipelining schedule.

Stages keep the full model's parameter names: a stage is the whole model object with the layers
it does not own set to None (and the embedding, final norm or lm_head removed where another
stage owns them), so checkpoints and exports never depend on the split.

Per-microbatch side inputs (position ids, document boundaries) are not passed between stages:
every pipeline rank reads the same data, so each stage looks them up by microbatch index, which
the schedule visits in increasing order on every stage. The last stage also reads its microbatch's
labels that way and computes the loss in the model's forward, as one process does (fused with
lm_head under model.fused_loss, so no [tokens, vocab] logits are formed; vocabulary-parallel under
TP): its output is the microbatch's token-loss sum, which the schedule's loss_fn only normalises.
The stage's forward hook turns the model's output into the one tensor the schedule passes on (hidden
states, or that loss sum on the last stage) and attaches MoE router losses to it so their gradients
flow without a second loss path.

Why hooks here (the README's "What is where" lists them): torch.distributed.pipelining calls
``stage(*tensors)`` with the tensors it passes between stages only, and sends on the one tensor
the stage returns; the pre-hook adds the microbatch's side inputs (``MicrobatchInputs``), the
post-hook returns that tensor. Both live in ``_install_stage_hooks``, nowhere else.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from xorl.distributed.parallel_config import PIPELINE_SCHEDULES, pipeline_grad_sync_per_step
from xorl.parallel.pipeline_step import AttachAuxLoss, MicrobatchInputs, TiedEmbeddings


def stage_indices(pp_rank: int, pp_size: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stages this pipeline rank runs: one, looped (rank, rank + P, ...) or V-shaped (ZBV)."""
    kind = PIPELINE_SCHEDULES[schedule].stages
    if kind == "one":
        return [pp_rank]
    if kind == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


def num_stages(pp_size: int, virtual_stages: int, schedule: str) -> int:
    kind = PIPELINE_SCHEDULES[schedule].stages
    return pp_size if kind == "one" else 2 * pp_size if kind == "v" else pp_size * virtual_stages


def layer_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Split layers as evenly as possible; earlier stages take the remainder (they also hold no head)."""
    if num_layers < stages:
        raise ValueError(
            f"model.num_hidden_layers={num_layers} is fewer than the {stages} pipeline stages; "
            "lower pipeline_parallel_size or virtual_pipeline_stages"
        )
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        ranges.append((start, start + n))
        start += n
    return ranges


def tied_embedding_group(state):
    """The group of this rank and the pipeline rank holding the other copy of a tied embedding.

    Every rank creates every pair's group (new_group is collective over the world), in mesh order,
    and keeps its own; under pipeline_parallel_size 2 the pair is the pipeline group itself.
    """
    if state.pp_size == 2:
        return state.pp_group
    ranks = state.mesh.mesh.reshape(state.pp_size, -1)
    mine = None
    for column in range(ranks.shape[1]):
        pair = [int(ranks[0, column]), int(ranks[-1, column])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


@dataclass
class PipelineRecord:
    """What ``split_into_stages`` did: this rank's stages and how the step feeds them."""

    stage_ids: list[int]  # the global indices of this rank's stages
    stages: list[nn.Module]  # the stage modules (full-model parameter names)
    num_stages: int  # over all pipeline ranks
    inputs: MicrobatchInputs  # the side inputs the stage hooks read
    # Tied embeddings (model.tie_word_embeddings): the first and the last stage each hold a copy of
    # the shared weight; ``tied_group`` joins this rank with the pipeline rank holding the other copy
    # (None where this rank holds neither, or both: ZBV puts stage 0 and the last stage on rank 0).
    tied: TiedEmbeddings | None = None

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


_FSDP_MICROBATCH_SETTERS = ("set_is_last_backward", "set_reshard_after_backward", "set_requires_gradient_sync")


@contextlib.contextmanager
def _fsdp_per_microbatch(module: FSDPModule):
    """Keep FSDP2's own per-microbatch behaviour through one backward of a pipeline stage.

    Why: torch's PipelineStage calls set_reshard_after_backward(False) and
    set_requires_gradient_sync(False) before every microbatch's backward and reduces once at the
    end of the step, so each stage would hold all its unsharded parameters and unsharded fp32
    gradients for the whole step (for a 70B model at PP=4: 17.5B parameters, ~105 GB per rank).
    With FSDP's defaults each block reshards after its backward and reduce-scatters its gradient
    into the sharded gradient right away: memory stays at the sharded size plus the blocks in
    flight, for one reduce-scatter per block per microbatch. The stage's own calls to those
    setters are made no-ops while its backward runs. train.pipeline_grad_sync: per_step chooses
    torch's behaviour instead, for the layouts whose memory holds it.
    """
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    for name in _FSDP_MICROBATCH_SETTERS:
        module.__dict__[name] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in _FSDP_MICROBATCH_SETTERS:
            del module.__dict__[name]


class ShardedGradPipelineStage(PipelineStage):
    """A PipelineStage whose FSDP2 blocks reshard and reduce-scatter after every microbatch
    (``reshard_per_microbatch``), or torch's PipelineStage (train.pipeline_grad_sync: per_step).

    Only for schedules with one full backward per microbatch. The zero-bubble schedules split it
    into an input pass and a later weight pass, and the weight pass finds the stage's parameters
    through ``module.parameters()`` as they were at the input pass, so they must stay unsharded in
    between: there the stage keeps torch's behaviour (parallel/parallelize.py then does not reshard after
    forward, and the stage reduces its gradients once per step).

    torch's behaviour (per_step): no reshard after backward and no gradient sync until the
    schedule's REDUCE_GRAD after the last microbatch, which runs each FSDP group's post-backward
    once: one reduce-scatter per block per step, the fp32 gradients held unsharded in between.
    """

    def __init__(self, *args, reshard_per_microbatch: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.reshard_per_microbatch = reshard_per_microbatch

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not (self.reshard_per_microbatch and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        with _fsdp_per_microbatch(self.submod):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


def _prune(model: nn.Module, first_layer: int, last_layer: int, is_first: bool, is_last: bool) -> nn.Module:
    stage = copy.deepcopy(model)
    layers = stage.model.layers
    for i in range(len(layers)):
        if not first_layer <= i < last_layer:
            layers[i] = None
    if not is_first:
        stage.model.embed_tokens = None
    if not is_last:
        stage.model.norm = None
        stage.lm_head = None
    return stage


def _install_stage_hooks(stage: nn.Module, stage_id: int, inputs: MicrobatchInputs, is_last: bool) -> None:
    """The two hooks torch's pipelining needs (module docstring): side inputs in, one tensor out."""

    def pre(module, args, kwargs):
        side = inputs.next_for(stage_id)
        if not is_last:  # only the stage with lm_head computes the loss
            side = {k: v for k, v in side.items() if k != "labels"}
        return args, {**kwargs, **side}

    def post(module, args, output):
        # [1], not a scalar, on the last stage: the schedule concatenates its outputs over microbatches.
        # A fresh tensor, not reshape's view: FSDP warns that in-place ops on a returned view lose hooks.
        out = torch.stack([output.loss_sum]) if is_last else output.logits
        if output.router_loss is not None:
            inputs.router_loss_sum += output.router_loss.detach().double()
            out = AttachAuxLoss.apply(out, output.router_loss, inputs.aux_scale)
        return out

    stage.register_forward_pre_hook(pre, with_kwargs=True)
    stage.register_forward_hook(post)


def split_into_stages(model: nn.Module, state, config) -> PipelineRecord:
    """This pipeline rank's stage modules (full-model parameter names kept) and their side inputs."""
    train = config.train
    total = num_stages(state.pp_size, train.virtual_pipeline_stages, train.pipeline_parallel_schedule)
    ranges = layer_ranges(len(model.model.layers), total)
    ids = stage_indices(state.pp_rank, state.pp_size, train.virtual_pipeline_stages, train.pipeline_parallel_schedule)
    inputs = MicrobatchInputs()
    stages = []
    for s in ids:
        stage = _prune(model, *ranges[s], is_first=s == 0, is_last=s == total - 1)
        _install_stage_hooks(stage, s, inputs, is_last=s == total - 1)
        stages.append(stage)
    tied = None
    if config.model.tie_word_embeddings:
        first, last = 0 in ids, total - 1 in ids
        # ZBV's V puts the last stage back on pipeline rank 0: both copies are local, no group.
        one_rank = total - 1 in stage_indices(0, state.pp_size, train.virtual_pipeline_stages,
                                               train.pipeline_parallel_schedule)
        group = None if one_rank else tied_embedding_group(state)  # collective: every rank takes part
        tied = TiedEmbeddings(group if first != last else None,
                              stages[ids.index(0)] if first else None,
                              stages[ids.index(total - 1)] if last else None)
    return PipelineRecord(ids, stages, total, inputs, tied)


def build_schedule(stage_ids: list[int], stage_modules: list[nn.Module], state, config, device,
                   example_input: torch.Tensor, hidden_shape: tuple[int, ...], loss_fn):
    """PipelineStages with static shapes (no shape-inference forward) and the configured schedule.

    The last stage's output is its microbatch's token-loss sum (fp32 [1], module docstring);
    ``loss_fn(loss_sum, labels)`` turns that (as a scalar) into the loss the schedule backpropagates."""
    train = config.train
    total = num_stages(state.pp_size, train.virtual_pipeline_stages, train.pipeline_parallel_schedule)
    # requires_grad: static stage metadata decides from it whether gradients flow back to the sender.
    hidden = torch.empty(hidden_shape, device="meta", requires_grad=True)
    stages = []
    for s, module in zip(stage_ids, stage_modules):
        inp = torch.empty(example_input.shape, dtype=example_input.dtype, device="meta") if s == 0 else hidden
        out = torch.empty((1,), dtype=torch.float32, device="meta") if s == total - 1 else hidden
        stages.append(ShardedGradPipelineStage(
            module, s, total, device, input_args=(inp,), output_args=(out,), group=state.pp_group,
            reshard_per_microbatch=not pipeline_grad_sync_per_step(train),
        ))
    info = PIPELINE_SCHEDULES[train.pipeline_parallel_schedule]
    cls = getattr(torch_schedules, info.torch_class)
    # scale_grads=False: the loss is already normalised by the global token count (xorl/trainer/loss.py).
    stage_arg = stages[0] if info.stages == "one" else stages
    return cls(stage_arg, n_microbatches=train.gradient_accumulation_steps,
               loss_fn=lambda loss_sum, labels: loss_fn(loss_sum[0], labels), scale_grads=False)
