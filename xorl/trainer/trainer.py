"""The training loop: config → process group → ParallelState → parallel model → steps.

Reads top to bottom. What makes every layout log the losses of one process:
- every rank starts from the weights of one process: the plans shard the model on the meta
  device, then each rank fills only its own shards, read from the HF folder or drawn by the
  seeded initialisation whose numbers depend on (seed, parameter name) alone;
- every layout sees the same global batch per optimizer step (xorl/data/loader.py);
- the loss is the token-weighted mean over the global batch and gradients are summed
  (xorl/trainer/loss.py, xorl/parallel/parallelize.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import xorl.run.folder as run_dir
import xorl.run.lock as run_lock
from xorl.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint
from xorl.checkpoint.peft_adapter import ADAPTER_DIR, save_adapter
from xorl.checkpoint.state import MODEL_CONFIG, Checkpointer, latest_checkpoint, load_checkpoint
from xorl.config import Config, compute_dtype
from xorl.data.loader import MicrobatchLoader, PackedDataset, data_report
from xorl.data.stream import StreamedLoader
from xorl.data.tokenizer import build_tokenizer
from xorl.distributed.init import init_distributed, world_size_from_env
from xorl.distributed.parallel_config import ParallelConfig
from xorl.distributed.parallel_state import init_parallel_state
from xorl.models.registry import build_model
from xorl.models.spec import EXPERTS_LAYOUT, QKV_LAYOUT
from xorl.nn.lora import cast_frozen_, frozen_dtype
from xorl.observability.memory_report import current_host_bytes, peak_host_bytes, report_startup, reset_peak_host_bytes
from xorl.observability.metrics import MetricsLogger, startup_summary
from xorl.observability.mfu import mfu
from xorl.observability.profiling import StepProfiler
from xorl.observability.sinks import open_sinks
from xorl.parallel.compile import check_compiled
from xorl.parallel.parallelize import build_step_plan
from xorl.run.preemption import PreemptionGuard
from xorl.run.preflight import RunSetup, prepare_run
from xorl.run.resume import apply_config_hparams
from xorl.run.watchdog import Heartbeat
from xorl.trainer.epochs import epoch_metrics
from xorl.trainer.evaluate import Evaluator
from xorl.trainer.grad_clip import clip_grad_norm_
from xorl.trainer.loss import count_label_tokens
from xorl.trainer.nonfinite import explain_nonfinite
from xorl.trainer.optim import build_optimizer, set_schedule_step


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


def initialise_part(part: nn.Module, config: Config) -> None:
    """Fill this rank's shards of a materialised (possibly sharded) model part: from the HF folder
    (each rank reads only its boxes) or by the seeded initialisation. fp32 master weights always;
    bf16 compute comes from FSDP's mixed-precision policy on GPU."""
    from xorl.distributed.shard_box import local_tensor

    if config.model.model_path:
        from xorl.models.hf_reader import load_hf_weights

        for buffer in part.buffers():  # state the files do not hold starts at zero
            local_tensor(buffer).zero_()
        load_hf_weights(part, config.model.model_path)
        if config.model.lora:  # the adapters are not in the base model's folder: peft's initialisation
            from xorl.models.seeded_init import seeded_init_

            seeded_init_(part, config.train.seed, config.model.initializer_range, adapters_only=True)
    else:
        from xorl.models.seeded_init import seeded_init_

        seeded_init_(part, config.train.seed, config.model.initializer_range)


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


class Trainer:
    def __init__(self, config: Config, setup: RunSetup | None = None):
        started = time.perf_counter()
        self.config = config
        world_size = world_size_from_env()
        # Every rule, the run folder and the checkpoint to resume, before any process group exists.
        self.setup = setup if setup is not None else prepare_run(config, world_size)
        self.device = init_distributed(config.train.collective_timeout_s)
        run_lock.hold(config.train.output_dir, self.device)  # one run per output_dir, before any write
        self.parallel_config = ParallelConfig.from_config(config, world_size)
        self.state = init_parallel_state(self.parallel_config, device_type=self.device.type)
        self.rank = dist.get_rank()
        self.checkpointer = Checkpointer(config.train.output_dir)
        # Build on the meta device, split for PP, then TP -> CP -> EP -> AC -> FSDP2, then allocate.
        with torch.device("meta"):
            model = build_model(config.model, fp8=config.train.fp8)
        frozen = frozen_dtype(config.model.lora, compute_dtype(config.train, self.device.type))
        if frozen is not None:  # LoRA's frozen base in bf16 (xorl/nn/lora.py)
            cast_frozen_(model, frozen)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # What the plans did (xorl/parallel/step_plan.py): the step asks it what to shard and reduce.
        self.step_plan = build_step_plan(model, self.state, config)
        self.parts = self.step_plan.modules
        materialise(self.parts, config, self.device)
        self.schedule = None  # the pipeline schedule, when the model is cut into stages
        if self.step_plan.pipelined:
            self._schedules: dict[int, object] = {}
            self.schedule = self._build_schedule()
        # One optimizer (and schedule) per model part, so optimizer state keys map to parameter names.
        pairs = [build_optimizer(part.parameters(), config.train) for part in self.parts]
        self.optimizers = [o for o, _ in pairs]
        self.schedulers = [s for _, s in pairs]
        if config.data.streaming:  # read and pack as training goes (xorl/data/stream.py)
            self.tokenizer = build_tokenizer(config.data.tokenizer)
            self.loader = StreamedLoader(config.data, self.tokenizer, config.data.micro_batch_size,
                                         config.train.gradient_accumulation_steps, self.state.dp_rank,
                                         self.state.dp_size, vocab_size=config.model.vocab_size)
        else:
            dataset = self.setup.dataset  # packed by prepare_run, before start-up (xorl/run/preflight.py)
            if dataset is None:
                dataset = PackedDataset(config.data, vocab_size=config.model.vocab_size)
            self.tokenizer = dataset.tokenizer
            self.loader = MicrobatchLoader(
                dataset, config.data.micro_batch_size, config.train.gradient_accumulation_steps,
                dp_rank=self.state.dp_rank, dp_size=self.state.dp_size,
            )
        # Validation (xorl/trainer/evaluate.py): the eval set, evaluated every train.eval_steps.
        self.evaluator = Evaluator(config, self.state, self.tokenizer.pad_id, self.setup.eval_dataset) \
            if config.train.eval_steps else None
        self.step = 0
        self._compile_unchecked = bool(config.train.compile)  # until the first step has run
        self.elapsed_offset_s = 0.0  # training time before this start (metrics' ``time`` is cumulative)
        self._clock: float | None = None
        self._maybe_resume()
        self._take_over_output_dir()
        if self.rank == 0:
            data_sequences = None if config.data.streaming else len(self.loader.dataset)
            print(startup_summary(config, self.parallel_config, self.num_parameters, self.step, self.device.type,
                                  data_sequences, n_trainable=self.num_trainable), flush=True)
            print("\n".join(data_report(self.loader) + (self.evaluator.report() if self.evaluator else [])), flush=True)
        # startup.json: each rank's peak host (and device) memory with the weights in place, before step 1.
        self.startup = report_startup(config.train.output_dir, self.device, time.perf_counter() - started,
                                      self.num_parameters,
                                      config.model.model_path or f"seeded init (seed {config.train.seed})")

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        point = self.setup.resume
        if point is None:
            return
        template = {"step": 0}  # DCP loads the keys it is given
        extra = load_checkpoint(point.path, self.parts, self.optimizers, template)
        self.step = int(extra["step"])
        # The schedule is a function of the step alone; its state dict would also carry one entry per
        # parameter group, and the groups differ between layouts (they follow the DTensor meshes).
        for scheduler in self.schedulers:
            set_schedule_step(scheduler, self.step)
        if self.setup.apply_config_hparams:
            apply_config_hparams(self.optimizers, self.schedulers, self.config.train)
        if self.config.data.streaming:
            self.loader.resume_at(self.step, point.consumed_sequences, point.data_state)
        else:
            self.loader.resume_at(self.step, point.consumed_sequences)
        self.elapsed_offset_s = point.elapsed_s

    def _take_over_output_dir(self) -> None:
        """Rank 0 clears an overwritten run and records this run's config, once every rank has read
        the folder (prepare_run) and loaded its checkpoint."""
        dist.barrier()
        if self.rank == 0:
            out = self.config.train.output_dir
            if self.setup.overwrite:
                run_dir.clear_output_dir(out)
            keep = self.setup.resume.path if self.setup.discard_later and self.setup.resume else None
            for line in run_dir.tidy_checkpoints(out, discard_after=keep):  # discard_later, unfinished saves
                print(f"xorl: {line}", flush=True)
            os.makedirs(out, exist_ok=True)
            run_dir.write_text_atomic(os.path.join(out, run_dir.CONFIG_NAME), self.config.to_yaml())
        dist.barrier()

    def elapsed_s(self) -> float:
        """Training time over every start of this run, up to now."""
        running = time.perf_counter() - self._clock if self._clock is not None else 0.0
        return self.elapsed_offset_s + running

    def save(self, blocking: bool = False) -> str:
        """Checkpoint this step, in the background unless ``blocking``; returns the path it will have
        once complete (``self.checkpointer.wait()``, the next save or the end of ``train`` waits for it)."""
        extra = {"step": self.step}
        state = {"step": self.step, "consumed_sequences": self.loader.first_sequence(self.step),
                 "elapsed_s": self.elapsed_s(), "global_batch": self.loader.global_batch,
                 "world_size": dist.get_world_size()}
        if self.config.data.streaming:  # every rank's stream stands at the same place after a step
            state["data_state"] = self.loader.state()
        if self.config.model.merge_qkv:
            state["qkv_layout"] = QKV_LAYOUT
        if self.config.model.num_experts:
            state["experts_layout"] = EXPERTS_LAYOUT
        files = {run_dir.RUN_CONFIG_NAME: self.config.to_yaml(), run_dir.TRAINER_STATE_NAME: json.dumps(state),
                 MODEL_CONFIG: json.dumps(dataclasses.asdict(self.config.model), indent=2)}
        if self.config.model.lora:  # the adapter alone, in peft's format: output_dir/adapter (this step's)
            save_adapter(self.parts, self.config.model, os.path.join(self.config.train.output_dir, ADAPTER_DIR),
                         self.step_plan.stages_group)
        return self.checkpointer.save(self.step, self.parts, self.optimizers, extra, files, blocking=blocking)

    def export_hf(self, folder: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """Write the current weights as a Hugging Face folder (collective: every rank calls it).

        Streamed from this step's checkpoint (saved first if the run has none for this step): every
        rank converts some of the output files, one tensor at a time (xorl/checkpoint/hf_export.py).
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

    # -- one optimizer step ----------------------------------------------------------------
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
        # The step's sums over every rank, and the gradient reductions the layout needs.
        sums = step_plan.after_backward(loss_sum, aux_sum)
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
        read = [sums[0], sums[1], grad_norm.double(), n_tok.double()]
        loss_total, aux_total, norm, tokens, *load = torch.stack(
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
                            load[0] if load else None)
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

    # -- the loop --------------------------------------------------------------------------
    def train(self, stop_at: int | None = None) -> list[StepResult]:
        """Run to ``train.max_steps``, or stop early after step ``stop_at`` (as a preempted job would;
        the learning-rate schedule still follows max_steps). Saves every ``save_steps`` and at the end."""
        train = self.config.train
        run_lock.hold(train.output_dir, self.device)  # again: an earlier train() of this Trainer gave it back
        last = train.max_steps if stop_at is None else min(stop_at, train.max_steps)
        sinks = open_sinks(train, self.config.to_dict(), self.step) if self.rank == 0 else []
        logger = MetricsLogger(train.output_dir, train.max_steps, self.step, enabled=self.rank == 0,
                               time_offset=self.elapsed_offset_s, sinks=sinks)
        heartbeat = Heartbeat(train.heartbeat_s, train.collective_timeout_s, enabled=self.rank == 0)
        preemption = PreemptionGuard(train.preempt_signals, train.preempt_grace_s, self.device)
        profiler = StepProfiler(train, self.rank, self.device, self.step)  # train.profile_steps, memory_snapshot_step
        results = []
        self._clock = time.perf_counter()
        try:
            while self.step < last:
                profiler.before_step(self.step + 1)  # outside the step's time
                t0 = time.perf_counter()
                with heartbeat.busy(f"step {self.step + 1}"):
                    try:
                        result = self.train_step()
                    except NonFiniteLossError as e:  # the weights, the data or divergence: say which
                        raise NonFiniteLossError(explain_nonfinite(self, e, initialise_part)) from None
                dt = time.perf_counter() - t0
                profiler.after_step(self.step)
                results.append(result)
                # metrics.jsonl gets every step; the console a line every log_steps (and the last).
                show = self.step % max(train.log_steps, 1) == 0 or self.step == train.max_steps
                # result.tokens counts label tokens of the global batch (the whole world's work).
                metrics = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                           **self._epoch_metrics(), **self._throughput_metrics(result.tokens / dt)}
                if result.aux_loss is not None:
                    metrics["router_loss"] = result.aux_loss
                if result.expert_load is not None:
                    metrics["expert_load"] = result.expert_load
                if self.evaluator is not None and self.evaluator.due(self.step):
                    with heartbeat.busy(f"evaluating after step {self.step}"):
                        metrics.update(self.evaluator.run(self))
                    show = True
                logger.log(result.step, metrics, elapsed_s=self.elapsed_s(), show=show)
                # Every rank stops after the same step (xorl/run/preemption.py): a collective, so a rank that
                # stalls between steps is reported here as it would be inside one.
                with heartbeat.busy(f"agreeing on a stop after step {self.step}"):
                    stop = preemption.should_stop()
                if stop and self.step < last:
                    with heartbeat.busy(f"saving the checkpoint of step {self.step} (preempted)"):
                        path = self.save(blocking=True)
                    raise preemption.stopped(stop, self.step, path)
                # Every save_steps, and always at max_steps (save_steps 0: that one only).
                periodic = train.save_steps and self.step % train.save_steps == 0
                if periodic or self.step == train.max_steps:
                    # In the background, except the last one: nothing is left to overlap it.
                    with heartbeat.busy(f"saving the checkpoint of step {self.step}"):
                        path = self.save(blocking=self.step == last)
                    logger.note(f"xorl: saved checkpoint {path}" if self.step == last else
                                f"xorl: saving checkpoint {path} (in the background)")
        finally:
            self.elapsed_offset_s, self._clock = self.elapsed_s(), None
            profiler.close(self.step)
            heartbeat.close()
            preemption.close()
            logger.close()
        self.checkpointer.wait()  # the last save is complete (and `latest`) when train returns
        if self.rank == 0 and self.config.data.streaming:  # what the stream left out or cut, once read
            summary = self.loader.counts.summary(self.config.data.seq_len)
            if summary:
                print(f"xorl: data: {summary}", flush=True)
        run_lock.release(train.output_dir)  # a process that trains again (tests, notebooks) takes it again
        return results

    def _throughput_metrics(self, tokens_per_s: float) -> dict[str, float | None]:
        """tokens/s (trained tokens of the global batch), MFU (None where the device's peak FLOP/s is not
        known: CPU, unless XORL_PEAK_TFLOPS), and this rank's peak memory since start (rank 0 logs its own: no
        collective for it): the CUDA caching allocator's on a GPU, the process's peak resident memory on CPU
        (where the tensors live)."""
        peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else peak_host_bytes())
        return {"tokens_per_s": tokens_per_s,
                "mfu": mfu(tokens_per_s, self.config.model, self.config.data.seq_len, dist.get_world_size(),
                           self.device),
                "peak_memory_gib": peak / 2**30}

    def _epoch_metrics(self) -> dict[str, float]:
        """The pass over the data and how much of it was seen (a stream's length is unknown: its pass only)."""
        if self.config.data.streaming:
            return {"epoch": self.loader.state()["epoch"] + 1}
        return epoch_metrics(self.loader.first_sequence(self.step), len(self.loader.dataset))


def run_training(config: Config, setup: RunSetup | None = None) -> list[StepResult]:
    trainer = Trainer(config, setup)
    results = trainer.train()
    if config.train.export_hf:
        run_lock.hold(config.train.output_dir, trainer.device)
        trainer.export_hf(os.path.join(config.train.output_dir, "hf"))
    return results
