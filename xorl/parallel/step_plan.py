"""``StepPlan``: what the parallel plans did, as the training step needs it.

``xorl.parallel.parallelize.build_step_plan`` applies the plans (xorl/parallel/*) and keeps the record each
returns; this object answers the step's questions from them and from the ParallelState, so that
``Trainer.train_step`` names no parallelism:

* the batch: the group whose label tokens make the loss's denominator (``token_count_group``), how
  a microbatch is sharded for context parallelism (``shard_batch``) and, under pipelining, the
  padded row length of a step (``row_bucket``);
* the shapes the pipeline stages exchange (``stage_io_shape``) and the schedule (``build_schedule``);
* the router balancing: how many balance groups share a step (``balance_groups``);
* what to reduce once the backward passes are done (``after_backward``: the router-loss shares
  over TP, the loss sums and the ranks' peak memory over the data, context and pipeline ranks, the
  TP partial gradients, the DDP gradient sum), the group the gradient norm spans
  (``grad_norm_group``) and what follows the optimizer step (``after_optimizer_step``: the routers'
  loads: bias updates, the expert_load metric).

The order and the arithmetic of each reduction are those the trainer had before this object.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class StepPlan:
    def __init__(self, state, config, parts: list, pipeline=None):
        self.state = state
        self.config = config
        self.parts = parts  # xorl.parallel.parallelize.ModelPart, one per model part
        self.pipeline = pipeline  # xorl.parallel.pipeline_parallel.PipelineRecord, or None
        model = config.model
        self.has_router_loss = model.num_experts > 0
        # Router load balancing is computed per group of ranks (the group the expert-parallel plan
        # gave the routers, from model.router_balance_scope): each rank's router loss is its share of
        # its group's loss, so the step averages over the groups among the data x context x tensor ranks.
        balance = next((part.router_balance for part in parts if part.router_balance is not None), None)
        group_size = 1 if balance is None or balance.group is None else dist.get_world_size(balance.group)
        self.balance_groups = state.dp_cp_tp_size // group_size if balance is not None else 1
        # The tensor-parallel record (the same on every part): activations between layers and
        # pipeline stages are TP sequence shards under sequence parallel.
        tensor = next((part.tensor for part in parts if part.tensor is not None), None)
        self.sequence_shards = tensor.sequence_shards if tensor is not None else 1
        # Each CP rank's shard is split again over TP under sequence parallel and in MoE blocks
        # (which run on TP token shards on every stage, so the multiple is the model's, not a part's).
        splits_over_tp = tensor is not None and (tensor.sequence_parallel or model.num_experts > 0)
        self.cp_local_multiple = tensor.tp.size if splits_over_tp else 1
        # This rank's slot among the data x context x pipeline ranks the step's sums span (after_backward).
        self.peak_memory_slot = state.pp_rank * state.dp_cp_size + state.dp_cp_rank

    # -- the model parts --------------------------------------------------------------------
    @property
    def modules(self) -> list[nn.Module]:
        return [part.module for part in self.parts]

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    @property
    def holds_first_stage(self) -> bool:
        """This rank runs the model's first stage (the embeddings): it takes the input ids."""
        return self.pipeline is None or self.pipeline.holds_first_stage

    @property
    def holds_last_stage(self) -> bool:
        """This rank runs the model's last stage (the lm_head): it computes the loss."""
        return self.pipeline is None or self.pipeline.holds_last_stage

    # -- the batch --------------------------------------------------------------------------
    @property
    def token_count_group(self):
        """The ranks whose label tokens are counted together (the loss's global denominator)."""
        return self.state.dp_cp_group

    def row_bucket(self, microbatches: list[dict]) -> int | None:
        """Under pipelining with ring attention: the row length every microbatch of the step is padded to.

        Why: ring attention pads each document to a multiple of 2 x ring (x ulysses), so rows come
        out at different lengths, and pipeline stages exchange fixed shapes. The step's longest
        padded row is rounded up to a granule of about seq_len / 16, so few distinct buckets (and
        schedules) arise; every pipeline rank reads the same microbatches, so all agree.
        """
        state = self.state
        if self.pipeline is None or state.ring_size == 1:
            return None
        from xorl.distributed.zigzag import padded_document_lengths

        multiple = 2 * state.ring_size * state.ulysses_size * self.cp_local_multiple
        granule = multiple * max(1, -(-self.config.data.seq_len // (16 * multiple)))
        longest = 0
        for mb in microbatches:
            cu = mb["cu_seqlens"].tolist()  # host data from the loader
            doc_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
            padded = padded_document_lengths(doc_lens, state.ring_size, state.ulysses_size, self.cp_local_multiple)
            longest = max(longest, sum(padded))
        return -(-longest // granule) * granule

    def shard_batch(self, mb: dict, pad_token_id: int, pad_to: int | None = None) -> dict:
        """This rank's share of a host microbatch (the zig-zag context-parallel shard; else all of it)."""
        if self.state.cp_size == 1:
            return mb
        from xorl.distributed.zigzag import prepare_context_parallel_batch

        cp = prepare_context_parallel_batch(
            mb["input_ids"], mb["labels"], mb["position_ids"], mb["cu_seqlens"],
            ring=self.state.ring_group, ulysses=self.state.ulysses_group,
            pad_token_id=pad_token_id, shift_labels=False, pad_to=pad_to,
            local_multiple=self.cp_local_multiple,
        )
        return {"input_ids": cp.input_ids, "labels": cp.labels, "position_ids": cp.position_ids,
                "cu_seqlens": cp.cu_seqlens, "max_seqlen": cp.max_seqlen, "token_mask": cp.token_mask}

    # -- pipeline stages --------------------------------------------------------------------
    def stage_io_shape(self, row_tokens: int) -> tuple[int, tuple[int, int, int]]:
        """(tokens a stage's input ids hold, the hidden-state shape between stages) for microbatch rows
        of ``row_tokens`` tokens. The last stage returns its loss sum, a scalar (parallel/pipeline_parallel.py)."""
        config = self.config
        tokens = config.data.micro_batch_size * row_tokens // self.state.cp_size
        return tokens, (1, tokens // self.sequence_shards, config.model.hidden_size)

    def build_schedule(self, row_tokens: int, loss_fn, device: torch.device):
        """The pipeline schedule for rows of ``row_tokens`` tokens (stages are built with static shapes)."""
        from xorl.parallel.pipeline_parallel import build_schedule

        tokens, hidden_shape = self.stage_io_shape(row_tokens)
        example = torch.zeros((1, tokens), dtype=torch.int64)
        return build_schedule(self.pipeline.stage_ids, self.modules, self.state, self.config, device, example,
                              hidden_shape=hidden_shape, loss_fn=loss_fn)

    def start_pipeline_step(self, microbatches: list[dict], aux_scale: float, device: torch.device) -> None:
        """The side inputs the stages read for this step's microbatches (parallel/pipeline_parallel.py): the
        model's forward arguments but the input ids, which the schedule passes to the first stage."""
        side = [{k: mb.get(k) for k in ("position_ids", "cu_seqlens", "max_seqlen", "token_mask", "labels")}
                for mb in microbatches]
        self.pipeline.inputs.start_step(side, aux_scale=aux_scale, device=device)

    @property
    def stage_router_loss_sum(self) -> torch.Tensor:
        """The router losses this rank's stages computed in the step (a device tensor)."""
        return self.pipeline.inputs.router_loss_sum

    # -- after backward, after the optimizer step -------------------------------------------
    def after_backward(self, loss_sum: torch.Tensor, aux_sum: torch.Tensor,
                       peak_memory_bytes: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step, after the last backward: reduce the step's sums and the gradients.

        Returns the [2] tensor (label-loss sum, router-loss sum) summed over every rank, and the
        largest of the ranks' ``peak_memory_bytes`` (a device scalar).

        Why the peaks ride on the sums' collective: the logged peak is the busiest rank's, and a
        collective of its own (a MAX) would cost a round trip a step. Each rank writes its peak into
        its own slot of a vector of zeros, so the sum over the ranks lists every rank's peak. The
        slots span the data, context and pipeline ranks the sums reduce over; the tensor-parallel
        ranks, equal shards of the same work, are not among them (the max is over the ranks that
        share this rank's TP coordinate).
        """
        state = self.state
        if state.tp_size > 1 and self.has_router_loss:  # router-loss shares differ over TP
            dist.all_reduce(aux_sum, group=state.tp_group)
        peaks = torch.zeros(state.dp_cp_size * state.pp_size, dtype=torch.float64, device=loss_sum.device)
        peaks[self.peak_memory_slot] = peak_memory_bytes
        sums = torch.cat([torch.stack([loss_sum, aux_sum]), peaks])  # one collective for all
        if state.dp_cp_size > 1:
            dist.all_reduce(sums, group=state.dp_cp_group)
        if state.pp_size > 1:  # only the last stage computed the loss; each stage its own router losses
            dist.all_reduce(sums, group=state.pp_group)
        # Replicated-over-TP parameters used on a shard of the data (SP norms, q/k norms): one
        # all-reduce per step adds up their partial gradients.
        from xorl.nn.tp_replicated import sum_tp_partial_grads

        sum_tp_partial_grads([part.tensor.partial_grads for part in self.parts if part.tensor is not None])
        if self.config.train.data_parallel_mode != "fsdp2" and state.dp_cp_size > 1:
            from xorl.parallel.step_reductions import all_reduce_gradients

            all_reduce_gradients([p for m in self.modules for p in m.parameters()], state.dp_cp_group)
        if self.pipeline is not None and self.pipeline.tied is not None:
            # Tied embeddings over pipeline stages: both copies take the sum of their gradients.
            self.pipeline.tied.sum_grads()
        return sums[:2], sums[2:].max()

    @property
    def stages_group(self):
        """The ranks holding the other pipeline stages of this rank's model (whole-model dicts merge over it)."""
        return self.state.pp_group

    @property
    def grad_norm_group(self):
        """The ranks whose parameters make one model (the norm spans every pipeline stage)."""
        return self.state.pp_group

    def grad_norm_parameters(self, params: list) -> list:
        """The parameters the gradient norm counts: all but the last stage's copy of a tied embedding
        under pipelining (after ``after_backward`` both copies hold the same gradient; one process
        has one such weight)."""
        tied = self.pipeline.tied if self.pipeline is not None else None
        head_copy = tied.head_copy() if tied is not None else None
        return params if head_copy is None else [p for p in params if p is not head_copy]

    def after_optimizer_step(self, device: torch.device) -> torch.Tensor | None:
        """MoE: the step's router loads summed over the data x context x tensor ranks (one
        all-reduce): auxiliary-loss-free balancing moves every router's bias by them, and the
        returned device scalar is the expert_load metric (None for a dense model)."""
        if not self.has_router_loss:
            return None
        from xorl.parallel.step_reductions import step_router_loads

        pp_group = self.state.pp_group if self.state.pp_size > 1 else None
        return step_router_loads(self.modules, self.state.dp_cp_tp_group, pp_group, device)
