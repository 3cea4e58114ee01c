"""The training loop: config → process group → ParallelState → parallel model → steps.

Reads top to bottom. What makes every layout log the losses of one process:
- every rank starts from the weights of one process: the plans shard the model on the meta
  device, then each rank fills only its own shards, read from the HF folder or drawn by the
  seeded initialisation whose numbers depend on (seed, parameter name) alone;
- every layout sees the same global batch per optimizer step (xorl/data/loader.py);
- the loss is the token-weighted mean over the global batch and gradients are summed
  (xorl/loss.py, xorl/parallelize.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from xorl.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from xorl.config import Config
from xorl.config_error import ConfigError
from xorl.data.loader import MicrobatchLoader, PackedDataset
from xorl.distributed.init import init_distributed, world_size_from_env
from xorl.distributed.parallel_config import ParallelConfig
from xorl.distributed.parallel_state import init_parallel_state
from xorl.export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint
from xorl.grad_clip import clip_grad_norm_
from xorl.loss import count_label_tokens, token_loss_sum
from xorl.memory_report import current_host_bytes, report_startup, reset_peak_host_bytes
from xorl.metrics import MetricsLogger
from xorl.mfu import mfu
from xorl.models.registry import build_model
from xorl.optim import build_optimizer
from xorl.parallelize import all_reduce_gradients, parallelize_model
from xorl.pipeline import build_schedule, split_into_stages


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


def initialise_part(part: nn.Module, config: Config) -> None:
    """Fill this rank's shards of a materialised (possibly sharded) model part: from the HF folder
    (each rank reads only its boxes) or by the seeded initialisation. fp32 master weights always;
    bf16 compute comes from FSDP's mixed-precision policy on GPU."""
    from xorl.distributed.shard_box import local_tensor

    if config.model.model_path:
        from xorl.models.hf_io import load_hf_weights

        for buffer in part.buffers():  # state the files do not hold starts at zero
            local_tensor(buffer).zero_()
        load_hf_weights(part, config.model.model_path)
    else:
        from xorl.models.seeded_init import seeded_init_

        seeded_init_(part, config.train.seed, config.model.initializer_range)


def initial_state_dict(config: Config) -> dict[str, torch.Tensor]:
    """The full initial weights in one process: what every layout's sharded start equals (tests)."""
    with torch.device("meta"):
        model = build_model(config.model)
    model.to_empty(device="cpu")
    model.tie_weights()
    initialise_part(model, config)
    return {k: v.to(torch.float32) for k, v in model.state_dict().items()}


def materialise(parts: list[nn.Module], config: Config, device: torch.device) -> None:
    """Allocate the (already sharded) meta parameters and fill each rank's own shards.

    Why this way: no rank ever holds the whole model. Each rank reads (or draws) only the boxes
    its shards hold, one checkpoint tensor's box at a time, so host memory at start-up is the
    rank's shards plus one box, for 70B and 235B models alike.
    """
    torch.manual_seed(config.train.seed)  # anything else random starts the same on every rank
    for part in parts:
        part.to_empty(device=device)
        initialise_part(part, config)


def check_model_path(config: Config) -> None:
    """A model_path folder that cannot load into the configured model: refused before any process group."""
    if not config.model.model_path:
        return
    from xorl.models.hf_io import hf_folder_problems

    with torch.device("meta"):
        model = build_model(config.model)
    problems = hf_folder_problems(model, config.model.model_path)
    if problems:
        raise ConfigError([f"model.model_path={config.model.model_path!r} does not match the model section: {p}"
                           for p in problems])


def check_trainer_support(config: Config) -> None:
    """Layouts the config accepts but this trainer cannot run yet: refused before any process group."""
    t = config.train
    problems = []
    if t.pipeline_parallel_size > 1 and t.ringattn_parallel_size > 1:
        problems.append(
            "train.pipeline_parallel_size > 1 with ringattn_parallel_size > 1: pipeline stages exchange "
            "fixed-shape activations, but ring attention pads each document, so shard lengths vary per "
            "microbatch; use ulysses_parallel_size for context parallelism under pipelining"
        )
    if config.model.attn_implementation == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        problems.append(
            "model.attn_implementation='flash_attn' but the flash-attn package is not installed; "
            "use attn_implementation: xorl (our Triton kernels) or pip install flash-attn"
        )
    if problems:
        raise ConfigError(problems)


class Trainer:
    def __init__(self, config: Config):
        started = time.perf_counter()
        self.config = config
        world_size = world_size_from_env()
        config.validate(world_size)  # every rule, before any process group exists
        check_trainer_support(config)
        check_model_path(config)
        self.device = init_distributed()
        self.parallel_config = ParallelConfig.from_config(config, world_size)
        self.state = init_parallel_state(self.parallel_config, device_type=self.device.type)
        self.rank = dist.get_rank()
        self.checkpointer = Checkpointer(config.train.output_dir)
        # Build on the meta device, split for PP, then TP -> CP -> EP -> AC -> FSDP2, then allocate.
        with torch.device("meta"):
            model = build_model(config.model)
        self.model_parameters = sum(p.numel() for p in model.parameters())  # tied weights once
        self.pipeline = None
        if self.state.pp_size > 1:
            stage_ids, stages, self.pp_inputs = split_into_stages(model, self.state, config)
            self.parts = [parallelize_model(stage, self.state, config) for stage in stages]
        else:
            self.parts = [parallelize_model(model, self.state, config)]
        materialise(self.parts, config, self.device)
        if self.state.pp_size > 1:
            self.pipeline = self._build_schedule(stage_ids)
        # One optimizer (and schedule) per model part, so optimizer state keys map to parameter names.
        pairs = [build_optimizer(part.parameters(), config.train) for part in self.parts]
        self.optimizers = [o for o, _ in pairs]
        self.schedulers = [s for _, s in pairs]
        self.dataset = PackedDataset(config.data, vocab_size=config.model.vocab_size)
        self.loader = MicrobatchLoader(
            self.dataset, config.data.micro_batch_size, config.train.gradient_accumulation_steps,
            dp_rank=self.state.dp_rank, dp_size=self.state.dp_size,
        )
        self.step = 0
        self._maybe_resume()
        # startup.json: each rank's peak host (and device) memory with the weights in place, before step 1.
        self.startup = report_startup(config.train.output_dir, self.device, time.perf_counter() - started,
                                      self.model_parameters,
                                      config.model.model_path or f"seeded init (seed {config.train.seed})")

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        resume = self.config.train.resume
        if not resume:
            return
        path = resume if isinstance(resume, str) else latest_checkpoint(self.config.train.output_dir)
        if path is None:
            return
        template = {"step": 0, "scheduler": self.schedulers[0].state_dict()}  # DCP loads the keys it is given
        extra = load_checkpoint(path, self.parts, self.optimizers, template)
        self.step = int(extra["step"])
        for scheduler in self.schedulers:
            scheduler.load_state_dict(extra["scheduler"])

    def save(self, blocking: bool = False) -> str:
        """Checkpoint this step, in the background unless ``blocking``; returns the path it will have
        once complete (``self.checkpointer.wait()``, the next save or the end of ``train`` waits for it)."""
        extra = {"step": self.step, "scheduler": self.schedulers[0].state_dict()}
        return self.checkpointer.save(self.step, self.parts, self.optimizers, extra,
                                      model_config=dataclasses.asdict(self.config.model), blocking=blocking)

    def export_hf(self, folder: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """Write the current weights as a Hugging Face folder (collective: every rank calls it).

        Streamed from this step's checkpoint (saved first if the run has none for this step): every
        rank converts some of the output files, one tensor at a time (xorl/export.py).
        """
        host_before = current_host_bytes()
        reset_peak_host_bytes()  # export.json: the peak of this export (with its save) alone
        self.checkpointer.wait()
        checkpoint = latest_checkpoint(self.config.train.output_dir)
        if checkpoint is None or not checkpoint.endswith(f"step_{self.step:08d}"):
            checkpoint = self.save(blocking=True)
        export_checkpoint(checkpoint, folder, self.config.model, max_shard_bytes=max_shard_bytes, device=self.device,
                          output_dir=self.config.train.output_dir, host_before=host_before)

    @property
    def model(self) -> nn.Module:
        """The model (without pipeline parallelism; else the first of this rank's stages)."""
        return self.parts[0]

    def parameters(self):
        return [p for part in self.parts for p in part.parameters()]

    def _build_schedule(self, stage_ids: list[int]):
        config, state = self.config, self.state
        tokens = config.data.micro_batch_size * config.data.seq_len // state.cp_size
        self._step_tokens = 1

        def loss_fn(logits, labels):
            return token_loss_sum(logits, labels) / self._step_tokens

        example = torch.zeros((1, tokens), dtype=torch.int64)
        return build_schedule(
            stage_ids, self.parts, state, config, self.device, example,
            hidden_shape=(1, tokens, config.model.hidden_size),
            output_shape=(1, tokens, config.model.vocab_size), loss_fn=loss_fn,
        )

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
        n_tok = int(count_label_tokens(microbatches, state.dp_cp_group))
        if self.pipeline is not None:
            loss_sum, aux_sum, has_aux = self._pipelined_forward_backward(microbatches, n_tok)
        else:
            loss_sum, aux_sum, has_aux = self._forward_backward(microbatches, n_tok)
        if state.dp_cp_size > 1:
            dist.all_reduce(loss_sum, group=state.dp_cp_group)
            if has_aux:
                dist.all_reduce(aux_sum, group=state.dp_cp_group)
        if state.pp_size > 1:  # only the last stage computed the loss; each stage its own router losses
            dist.all_reduce(loss_sum, group=state.pp_group)
            if has_aux:
                dist.all_reduce(aux_sum, group=state.pp_group)
        if self.config.train.data_parallel_mode != "fsdp2" and state.dp_cp_size > 1:
            all_reduce_gradients(self.parameters(), state.dp_cp_group)
        grad_norm = clip_grad_norm_(self.parameters(), self.config.train.max_grad_norm, state.pp_group)
        loss_value = float(loss_sum) / max(n_tok, 1)
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"step {self.step}: loss={loss_value} grad_norm={grad_norm}; stopping with the last "
                f"good checkpoint left in {self.config.train.output_dir}"
            )
        lr = self.schedulers[0].get_last_lr()[0]
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        ga = len(microbatches)
        result = StepResult(self.step, loss_value, grad_norm, lr, n_tok,
                            float(aux_sum) / (ga * state.dp_cp_size) if has_aux else None)
        self.step += 1
        return result

    def _forward_backward(self, microbatches: list[dict], n_tok: int):
        state = self.state
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
        return loss_sum, aux_sum, has_aux

    def _pipelined_forward_backward(self, microbatches: list[dict], n_tok: int):
        """One schedule step over the microbatches; returns this rank's loss sum (last stage only)."""
        state = self.state
        ga = len(microbatches)
        side = [{"position_ids": mb["position_ids"].to(self.device), "cu_seqlens": mb["cu_seqlens"].to(self.device),
                 "max_seqlen": mb["max_seqlen"]} for mb in microbatches]
        self.pp_inputs.start_step(side, aux_scale=1.0 / (ga * state.dp_cp_size))
        for part in self.parts:
            part.reset_microbatch_counter()
        self._step_tokens = max(n_tok, 1)
        first, last = state.is_first_stage, state.is_last_stage
        if len(self.parts) > 1:  # looped / V schedules: stage 0 and the last stage may both be here
            first = any(isinstance(getattr(p.model, "embed_tokens", None), nn.Module) for p in self.parts)
            last = any(p.lm_head is not None for p in self.parts)
        args = (torch.cat([mb["input_ids"] for mb in microbatches]).to(self.device),) if first else ()
        target = torch.cat([mb["labels"] for mb in microbatches]).to(self.device) if last else None
        losses: list[torch.Tensor] = []
        self.pipeline.step(*args, target=target, losses=losses)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for loss in losses:  # each is this microbatch's token-loss sum / n_tok
            loss_sum += loss.detach().double().cpu() * self._step_tokens
        aux = torch.tensor(self.pp_inputs.router_loss_sum, dtype=torch.float64)
        return loss_sum, aux, self.config.model.num_experts > 0
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
                    # result.tokens counts label tokens of the global batch (the whole world's work).
                    metrics = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                               "tokens_per_s": result.tokens / dt, **self._memory_metrics()}
                    utilisation = mfu(result.tokens / dt, self.config.model, self.config.data.seq_len,
                                      dist.get_world_size(), self.device)
                    if utilisation is not None:
                        metrics["mfu"] = utilisation
                    if result.aux_loss is not None:
                        metrics["router_loss"] = result.aux_loss
                    logger.log(result.step, metrics)
                if train.save_steps and self.step % train.save_steps == 0:
                    self.save(blocking=self.step == last)  # nothing left to overlap the last one
        finally:
            logger.close()
        self.checkpointer.wait()  # the last save is complete (and `latest`) when train returns
        return results

    def _memory_metrics(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}


def run_training(config: Config) -> list[StepResult]:
    trainer = Trainer(config)
    results = trainer.train()
    if config.train.export_hf:
        trainer.export_hf(os.path.join(config.train.output_dir, "hf"))
    return results
