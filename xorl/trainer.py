"""The training loop: config → process group → ParallelState → parallel model → steps.

Reads top to bottom. What makes every layout log the losses of one process:
- every rank builds the same initial weights (rank 0's full state dict, broadcast, or the same
  seeded initialisation), then the plans shard them;
- every layout sees the same global batch per optimizer step (xorl/data/loader.py);
- the loss is the token-weighted mean over the global batch and gradients are summed
  (xorl/loss.py, xorl/parallelize.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from xorl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from xorl.config import Config
from xorl.config_error import ConfigError
from xorl.data.loader import MicrobatchLoader, PackedDataset
from xorl.distributed.init import init_distributed, world_size_from_env
from xorl.distributed.parallel_config import ParallelConfig
from xorl.distributed.parallel_state import init_parallel_state
from xorl.grad_clip import clip_grad_norm_
from xorl.loss import count_label_tokens, token_loss_sum
from xorl.metrics import MetricsLogger
from xorl.models.registry import build_model
from xorl.optim import build_optimizer
from xorl.parallelize import all_reduce_gradients, parallelize_model


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


def build_initial_model(config: Config) -> nn.Module:
    """The full model with its initial weights, identical on every rank.

    Weights come from ``model.model_path`` (a local HF folder) when given, else from a seeded
    initialisation; either way every rank holds the same numbers before the plans shard them.
    """
    torch.manual_seed(config.train.seed)
    model = build_model(config.model)
    if config.model.model_path:
        from xorl.models.hf_io import load_hf_weights

        load_hf_weights(model, config.model.model_path)
    # fp32 master weights always; bf16 compute comes from FSDP's mixed-precision policy on GPU.
    return model.to(torch.float32)


def check_trainer_support(config: Config) -> None:
    """Layouts the config accepts but this trainer cannot run yet: refused before any process group."""
    t = config.train
    problems = []
    if t.pipeline_parallel_size > 1:
        problems.append(
            "train.pipeline_parallel_size > 1: the trainer does not run pipeline schedules yet; "
            "use pipeline_parallel_size: 1 (fold those ranks into data_parallel_shard_size)"
        )
    if problems:
        raise ConfigError(problems)


class Trainer:
    def __init__(self, config: Config):
        self.config = config
        world_size = world_size_from_env()
        config.validate(world_size)  # every rule, before any process group exists
        check_trainer_support(config)
        self.device = init_distributed()
        self.parallel_config = ParallelConfig.from_config(config, world_size)
        self.state = init_parallel_state(self.parallel_config, device_type=self.device.type)
        self.rank = dist.get_rank()
        model = build_initial_model(config)
        self.model = parallelize_model(model.to(self.device), self.state, config)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), config.train)
        self.dataset = PackedDataset(config.data, vocab_size=config.model.vocab_size)
        self.loader = MicrobatchLoader(
            self.dataset, config.data.micro_batch_size, config.train.gradient_accumulation_steps,
            dp_rank=self.state.dp_rank, dp_size=self.state.dp_size,
        )
        self.step = 0
        self._maybe_resume()

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        resume = self.config.train.resume
        if not resume:
            return
        path = resume if isinstance(resume, str) else latest_checkpoint(self.config.train.output_dir)
        if path is None:
            return
        template = {"step": 0, "scheduler": self.scheduler.state_dict()}  # DCP loads the keys it is given
        extra = load_checkpoint(path, [self.model], [self.optimizer], template)
        self.step = int(extra["step"])
        self.scheduler.load_state_dict(extra["scheduler"])

    def save(self) -> str:
        extra = {"step": self.step, "scheduler": self.scheduler.state_dict()}
        return save_checkpoint(self.config.train.output_dir, self.step, [self.model], [self.optimizer], extra)

    # -- one optimizer step ----------------------------------------------------------------
    def _shard_for_context_parallel(self, mb: dict) -> dict:
        if self.state.cp_size == 1:
            return mb
        from xorl.distributed.zigzag import prepare_context_parallel_batch

        cp = prepare_context_parallel_batch(
            mb["input_ids"], mb["labels"], mb["position_ids"], mb["cu_seqlens"],
            ring=self.state.ring_group, ulysses=self.state.ulysses_group,
            pad_token_id=self.dataset.tokenizer.pad_id, shift_labels=False,
        )
        return {"input_ids": cp.input_ids, "labels": cp.labels, "position_ids": cp.position_ids,
                "cu_seqlens": cp.cu_seqlens, "max_seqlen": cp.max_seqlen}

    def train_step(self) -> StepResult:
        state = self.state
        microbatches = [self._shard_for_context_parallel(mb) for mb in self.loader.microbatches(self.step)]
        global_tokens = count_label_tokens(microbatches, state.dp_cp_group)
        n_tok = int(global_tokens)
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        has_aux = False
        ga = len(microbatches)
        for mb in microbatches:
            out = self.model(
                mb["input_ids"].to(self.device),
                position_ids=mb["position_ids"].to(self.device),
                cu_seqlens=mb["cu_seqlens"].to(self.device),
                max_seqlen=mb["max_seqlen"],
            )
            local_sum = token_loss_sum(out.logits, mb["labels"].to(self.device))
            loss = local_sum / max(n_tok, 1)
            if out.router_loss is not None:
                # Router losses are per-rank means; sum over ranks and microbatches of 1/(ga·dp_cp)
                # of each is their mean, matching the "micro-batch local" definition.
                loss = loss + out.router_loss / (ga * state.dp_cp_size)
                aux_sum += out.router_loss.detach().double().cpu()
                has_aux = True
            loss.backward()
            loss_sum += local_sum.detach().double().cpu()
        if state.dp_cp_size > 1:
            dist.all_reduce(loss_sum, group=state.dp_cp_group)
            if has_aux:
                dist.all_reduce(aux_sum, group=state.dp_cp_group)
        if self.config.train.data_parallel_mode != "fsdp2" and state.dp_cp_size > 1:
            all_reduce_gradients(self.model.parameters(), state.dp_cp_group)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.train.max_grad_norm, state.pp_group)
        loss_value = float(loss_sum) / max(n_tok, 1)
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"step {self.step}: loss={loss_value} grad_norm={grad_norm}; stopping with the last "
                f"good checkpoint left in {self.config.train.output_dir}"
            )
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(self.step, loss_value, grad_norm, lr, n_tok,
                            float(aux_sum) / (ga * state.dp_cp_size) if has_aux else None)
        self.step += 1
        return result

    # -- the loop --------------------------------------------------------------------------
    def train(self, stop_at: int | None = None) -> list[StepResult]:
        """Run to ``train.max_steps``, or stop early after step ``stop_at`` (as a preempted job would;
        the learning-rate schedule still follows max_steps)."""
        train = self.config.train
        last = train.max_steps if stop_at is None else min(stop_at, train.max_steps)
        logger = MetricsLogger(train.output_dir, train.max_steps, self.step, enabled=self.rank == 0)
        results = []
        try:
            while self.step < last:
                t0 = time.perf_counter()
                result = self.train_step()
                dt = time.perf_counter() - t0
                results.append(result)
                if self.step % max(train.log_steps, 1) == 0 or self.step == train.max_steps:
                    metrics = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                               "tokens_per_s": result.tokens / dt, **self._memory_metrics()}
                    if result.aux_loss is not None:
                        metrics["router_loss"] = result.aux_loss
                    logger.log(result.step, metrics)
                if train.save_steps and self.step % train.save_steps == 0:
                    self.save()
        finally:
            logger.close()
        return results

    def _memory_metrics(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}


def run_training(config: Config) -> list[StepResult]:
    trainer = Trainer(config)
    results = trainer.train()
    if config.train.export_hf:
        from xorl.export import export_hf

        export_hf(trainer.model, config, os.path.join(config.train.output_dir, "hf"))
    return results
