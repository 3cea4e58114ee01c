"""One optimizer step of the Trainer (xorl/trainer/trainer.py): the microbatches onto the device,
forward and backward (or one pipeline schedule step), the step's reductions, clipping, the optimizer,
and the one host read.

``TrainStep`` holds the step's methods; ``Trainer`` inherits them and its ``__init__`` sets what they
read: ``config``, ``device``, ``step``, ``step_plan``, ``loader``, ``tokenizer``, ``optimizers``,
``schedulers``, ``schedule`` / ``_schedules`` (under pipelining), ``model`` and ``parameters()``. Like the
trainer it names no parallelism: the StepPlan (xorl/parallel/step_plan.py) answers for the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xorl.observability.memory_report import peak_memory_bytes
from xorl.parallel.compile import check_compiled
from xorl.trainer.grad_clip import clip_grad_norm_
from xorl.trainer.loss import count_label_tokens


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the last good checkpoint is left as it was."""


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    aux_loss: float | None = None
    expert_load: float | None = None  # MoE: the busiest expert's tokens / the mean's, worst layer
    peak_memory_gib: float | None = None  # the busiest rank's peak memory since start, up to this backward


class TrainStep:
    """The Trainer's optimizer step (see the module docstring for the attributes it reads)."""

    def _build_schedule(self, row_tokens: int | None = None):
        """The pipeline schedule for microbatch rows of ``row_tokens`` tokens (default: seq_len).

        Stages are built with static shapes. Where the layout pads rows per document, each step is
        padded to a bucket (``StepPlan.row_bucket``) and one schedule is kept per bucket
        (``self._schedules``); the stage modules are shared.
        """
        row_tokens = self.config.data.seq_len if row_tokens is None else row_tokens
        self._step_tokens = 1

        def loss_fn(loss_sum, labels):  # the last stage's output: its microbatch's token-loss sum
            return loss_sum / self._step_tokens

        return self.step_plan.build_schedule(row_tokens, loss_fn, self.device)

    def _to_device(self, mb: dict) -> dict:
        """Host batch -> compute device: pinned memory and non-blocking copies, so the host runs ahead."""
        if self.device.type != "cuda":
            return mb
        return {k: v.pin_memory().to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in mb.items()}

    def shard_microbatches(self, raw: list[dict]) -> list[dict]:
        """This rank's shares of a step's host microbatches; under pipelining with padded rows, the
        schedule of their row length becomes ``self.schedule``."""
        step_plan = self.step_plan
        bucket = step_plan.row_bucket(raw)
        host_mbs = [step_plan.shard_batch(mb, self.tokenizer.pad_id, bucket) for mb in raw]
        if bucket is not None:  # padded rows under pipelining: the schedule of this step's row length
            if bucket not in self._schedules:
                self._schedules[bucket] = self._build_schedule(bucket)
            self.schedule = self._schedules[bucket]
        return host_mbs

    def train_step(self) -> StepResult:
        """One optimizer step. The host reads the device once, after the optimizer step is queued.

        Why: every read (.item(), float(t), .cpu()) stalls the host until the GPU has caught up, and
        the GPU then idles while the host queues the next kernels. The loss sums, token count, router
        losses and gradient norm stay device tensors until the one read at the end, which also
        checks that the loss and norm are finite.
        """
        step_plan = self.step_plan
        host_mbs = self.shard_microbatches(self.loader.microbatches(self.step))
        n_tok = count_label_tokens(host_mbs, step_plan.token_count_group, self.device)
        microbatches = [self._to_device(mb) for mb in host_mbs]
        if self.schedule is not None:
            loss_sum, aux_sum = self._pipelined_forward_backward(microbatches, n_tok)
        else:
            loss_sum, aux_sum = self._forward_backward(microbatches, n_tok)
        # The step's sums and the ranks' peak memory over every rank, and the gradient reductions the
        # layout needs. The peak is read here, not after the optimizer step, to ride on the sums'
        # collective: the optimizer step's own peak (step 1's Adam states) shows from the next step.
        sums, peak_memory = step_plan.after_backward(loss_sum, aux_sum, float(peak_memory_bytes(self.device)))
        params = self.parameters()
        grad_norm = clip_grad_norm_(params, self.config.train.max_grad_norm, step_plan.grad_norm_group,
                                    counted=step_plan.grad_norm_parameters(params))
        lr = self.schedulers[0].get_last_lr()[0]
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        expert_load = step_plan.after_optimizer_step(self.device)
        ga = len(microbatches)
        read = [sums[0], sums[1], grad_norm.double(), n_tok.double(), peak_memory]
        loss_total, aux_total, norm, tokens, peak, *load = torch.stack(
            read if expert_load is None else [*read, expert_load]
        ).tolist()  # the step's one host read
        loss_value = loss_total / max(tokens, 1)
        if not (math.isfinite(loss_value) and math.isfinite(norm)):
            raise NonFiniteLossError(
                f"step {self.step}: loss={loss_value} grad_norm={norm}")  # train() says what is at fault
        if self._compile_unchecked:  # train.compile: every compiled block ran its graph, none eager
            check_compiled([part.compiled for part in step_plan.parts if part.compiled is not None])
            self._compile_unchecked = False
        result = StepResult(self.step, loss_value, norm, lr, int(tokens),
                            aux_total / (ga * step_plan.balance_groups) if step_plan.has_router_loss else None,
                            load[0] if load else None, peak / 2**30)
        self.step += 1
        return result

    def _forward_backward(self, microbatches: list[dict], n_tok: torch.Tensor):
        """Forward and backward of each microbatch; returns (label-loss sum, router-loss sum) on device."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        ga = len(microbatches)
        denominator = n_tok.clamp(min=1).to(torch.float32)
        for mb in microbatches:
            out = self.model(
                mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                max_seqlen=mb["max_seqlen"], token_mask=mb.get("token_mask"), labels=mb["labels"],
            )
            local_sum = out.loss_sum  # fused from the hidden states unless model.fused_loss is off
            loss = local_sum / denominator
            if out.router_loss is not None:
                # Each rank's router loss is its share of its balance group's loss (xorl/nn/router.py);
                # summed over the group and averaged over the step's groups x microbatches.
                loss = loss + out.router_loss / (ga * self.step_plan.balance_groups)
                aux_sum += out.router_loss.detach().double()
            loss.backward()
            loss_sum += local_sum.detach().double()
        return loss_sum, aux_sum

    def _pipelined_forward_backward(self, microbatches: list[dict], n_tok: torch.Tensor):
        """One schedule step over the microbatches; returns this rank's (loss sum, router-loss sum)."""
        step_plan = self.step_plan
        ga = len(microbatches)
        step_plan.start_pipeline_step(microbatches, aux_scale=1.0 / (ga * step_plan.balance_groups), device=self.device)
        self._step_tokens = n_tok.clamp(min=1).to(torch.float32)
        # Looped / V schedules: the first and the last stage may both be on this rank.
        args = (torch.cat([mb["input_ids"] for mb in microbatches]),) if step_plan.holds_first_stage else ()
        # The last stage reads its labels as a side input; the schedule still splits a target for loss_fn.
        target = torch.cat([mb["labels"] for mb in microbatches]) if step_plan.holds_last_stage else None
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:  # each is this microbatch's token-loss sum / n_tok
            loss_sum += loss.detach().double() * self._step_tokens.double()
        return loss_sum, step_plan.stage_router_loss_sum
