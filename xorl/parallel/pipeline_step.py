"""What a pipelined step runs every microbatch: the stages' side inputs, router losses, tied embeddings.

Set up once by xorl/parallel/pipeline_parallel.py (``split_into_stages``), used every step:
``MicrobatchInputs`` holds the step's side inputs (positions, document boundaries, labels) that the
stage hooks read by microbatch index; ``AttachAuxLoss`` lets an earlier stage's router loss join the
backward through the tensor it passes on; ``TiedEmbeddings.sum_grads`` adds the two copies' gradients
of a tied embedding after the last backward (``StepPlan.after_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``hidden``; in backward also sends gradient ``scale`` into ``aux_loss``.

    Why: under pipelining the schedule backpropagates only from the last stage's loss, so a
    router loss computed on an earlier stage joins the graph through the tensor it passes on.
    """

    @staticmethod
    def forward(ctx, hidden, aux_loss, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return hidden.clone()  # a fresh tensor: FSDP warns that in-place ops on a returned view lose hooks

    @staticmethod
    def backward(ctx, grad):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class MicrobatchInputs:
    """The side inputs of this step's microbatches, and a visit counter per stage."""

    def __init__(self) -> None:
        self.kwargs: list[dict] = []
        self.aux_scale = 0.0
        self.router_loss_sum = torch.zeros((), dtype=torch.float64)
        self._visits: dict[int, int] = {}

    def start_step(self, kwargs: list[dict], aux_scale: float, device: torch.device) -> None:
        self.kwargs = kwargs
        self.aux_scale = aux_scale
        self._visits = {}  # every stage starts again at microbatch 0
        # A device tensor: the stages add their router losses without reading them on the host.
        self.router_loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def next_for(self, stage_id: int) -> dict:
        """The side inputs of the next microbatch stage ``stage_id`` runs (the schedule visits them in order)."""
        visit = self._visits.get(stage_id, 0)
        self._visits[stage_id] = visit + 1
        return self.kwargs[visit % max(len(self.kwargs), 1)]


@dataclass
class TiedEmbeddings:
    """The two copies of a tied embedding / lm_head weight across pipeline stages, Megatron-style.

    The first stage's ``embed_tokens`` and the last stage's ``lm_head`` start equal (the seeded
    initialisation gives a tied lm_head the embedding's numbers; the HF loader fills it from the
    embedding), and after every backward ``sum_grads`` adds the two gradients, so both copies take
    the one gradient one process computes, and identical optimizer updates. Under FSDP2 and TP both
    are [vocab, hidden] parameters sharded the same way over the same meshes (Shard(0)), so the local
    gradient shards of the two ranks correspond element for element.
    """

    group: object | None  # the 2-rank group (first, last pipeline rank, same other mesh coordinates)
    first_stage: nn.Module | None  # the stage holding embed_tokens, where this rank runs it
    last_stage: nn.Module | None  # the stage holding lm_head, where this rank runs it

    def params(self) -> list[torch.Tensor]:
        # Read at use: the TP plan replaces the modules and FSDP2 their parameters after the split.
        head = self.head_copy()
        embed = self.first_stage.model.embed_tokens.weight if self.first_stage is not None else None
        return [p for p in (embed, head) if p is not None]

    def head_copy(self) -> torch.Tensor | None:
        """The lm_head's copy, which the gradient norm leaves out (it counts the weight once)."""
        return self.last_stage.lm_head.weight if self.last_stage is not None else None

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Each copy's gradient becomes the sum of both copies' (a local sum when one rank holds both)."""
        params = [p for p in self.params() if p.requires_grad]
        if not params:  # a frozen embedding (LoRA): nothing to keep in step
            return
        grads = [_local_grad(p) for p in params]
        total = grads[0] if len(grads) == 1 else grads[0] + grads[1]
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            if g is not total:
                g.copy_(total)


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's gradient shard. Every stage runs every microbatch's backward, so each copy has one."""
    if param.grad is None:
        raise RuntimeError("a tied embedding copy took no gradient this step: its stage ran no backward")
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad
