"""Validation: the loss of a fixed eval set, on the training layout, changing no training state.

The eval set is ``data.eval_dataset`` or the rows ``data.eval_fraction`` holds out of training
(xorl/data/loader.py), packed like the training data and read in file order. It is cut into global
batches of the training shape (micro_batch_size x gradient_accumulation_steps x data-parallel
sequences), each data-parallel rank taking its microbatches the training loader's way; the last
batch is filled with empty sequences (padding, no target) so every rank runs the same number of
forwards (their collectives must match). ``train.eval_batches`` limits an evaluation to the first
batches (0: the whole set, the default: the loss is then that of every trained token of the set).

The loss is sum of cross-entropies / number of target tokens over the evaluated sequences (the same
normalisation as training: masked tokens count in neither), from each rank's local sum reduced over
the data x context ranks (and the pipeline ranks: only the last stage has the loss); the token
count comes from the host labels, which every rank holds whole. So every layout gives the loss of
one process up to summation order. The forward runs under torch.no_grad with every module in eval
mode (the MoE routers then keep no load statistics for their bias update); pipelined models run
the schedule's forward-only ``eval`` (1F1B, GPipe, Interleaved1F1B; torch's zero-bubble schedules
run their backward actions there too, so validation refuses them: xorl/config/validate.py). No
parameter, gradient, optimizer state, data position or random-number state changes: the next
training step is bitwise what it would have been.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from xorl.data.loader import PackedDataset
from xorl.data.packing import IGNORE_INDEX, PackedSequence, collate


def _empty_sequence(seq_len: int, pad_id: int) -> PackedSequence:
    return PackedSequence(torch.full((seq_len,), pad_id, dtype=torch.int64),
                          torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64),
                          torch.arange(seq_len, dtype=torch.int64), [seq_len])


class Evaluator:
    def __init__(self, config, state, pad_id: int, dataset: PackedDataset | None = None):
        # ``dataset``: the eval set prepare_run read before start-up (xorl/run/preflight.py), else read here
        if dataset is None:
            dataset = PackedDataset(config.data, vocab_size=config.model.vocab_size, part="eval")
        self.dataset = dataset
        data, train = config.data, config.train
        self.every, self.last_step = train.eval_steps, train.max_steps
        self.mbs, self.ga = data.micro_batch_size, train.gradient_accumulation_steps
        self.dp_rank, self.dp_size = state.dp_rank, state.dp_size
        self.batch = self.mbs * self.ga * self.dp_size  # sequences per global batch
        sequences = list(self.dataset.sequences)
        batches = -(-len(sequences) // self.batch)
        if train.eval_batches:
            batches = min(batches, train.eval_batches)
        sequences = sequences[: batches * self.batch]
        sequences += [_empty_sequence(data.seq_len, pad_id)] * (batches * self.batch - len(sequences))
        self.sequences = sequences
        self.num_batches = batches
        # Every rank holds the whole eval set on the host: the denominator needs no collective.
        self.target_tokens = sum(int((s.labels != IGNORE_INDEX).sum()) for s in sequences)

    def report(self) -> list[str]:
        return self.dataset.report() + [
            f"xorl: eval: {self.num_batches} batches of {self.batch} sequences ({self.target_tokens} target tokens) "
            f"every {self.every} steps and at step {self.last_step}"]

    def due(self, step: int) -> bool:
        """After optimizer step ``step`` (1-based count of steps done)."""
        return self.every > 0 and (step % self.every == 0 or step == self.last_step)

    def microbatches(self, batch: int) -> list[dict]:
        """This rank's microbatches of eval batch ``batch`` (the training loader's split)."""
        first = batch * self.batch
        return [collate([self.sequences[first + (m * self.dp_size + self.dp_rank) * self.mbs + j]
                         for j in range(self.mbs)]) for m in range(self.ga)]

    def run(self, trainer) -> dict[str, float]:
        """``{"eval_loss", "eval_ppl"}`` of the model as it stands (a collective: every rank calls it)."""
        modules = [m for part in trainer.parts for m in part.modules()]
        was_training = [m.training for m in modules]
        for m in modules:
            m.train(False)
        try:
            with torch.no_grad():
                loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
                for batch in range(self.num_batches):
                    host_mbs = trainer.shard_microbatches(self.microbatches(batch))
                    microbatches = [trainer._to_device(mb) for mb in host_mbs]
                    if trainer.schedule is not None:
                        loss_sum += self._pipelined(trainer, microbatches)
                    else:
                        for mb in microbatches:
                            out = trainer.model(
                                mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"],
                                max_seqlen=mb["max_seqlen"], token_mask=mb.get("token_mask"), labels=mb["labels"])
                            loss_sum += out.loss_sum.double()
        finally:
            for m, flag in zip(modules, was_training):
                m.train(flag)
        state = trainer.state
        if state.dp_cp_size > 1:
            dist.all_reduce(loss_sum, group=state.dp_cp_group)
        if state.pp_size > 1:  # only the last stage computed a loss
            dist.all_reduce(loss_sum, group=state.pp_group)
        loss = loss_sum.item() / max(self.target_tokens, 1)  # the evaluation's one host read
        return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else float("inf")}

    @staticmethod
    def _pipelined(trainer, microbatches: list[dict]) -> torch.Tensor:
        """The schedule's forward-only pass over one batch; this rank's loss sum (0 off the last stage)."""
        step_plan = trainer.step_plan
        step_plan.start_pipeline_step(microbatches, aux_scale=0.0, device=trainer.device)
        saved, trainer._step_tokens = trainer._step_tokens, 1  # the schedule's loss_fn then gives plain sums
        try:
            args = (torch.cat([mb["input_ids"] for mb in microbatches]),) if step_plan.holds_first_stage else ()
            target = torch.cat([mb["labels"] for mb in microbatches]) if step_plan.holds_last_stage else None
            losses: list[torch.Tensor] = []
            trainer.schedule.eval(*args, target=target, losses=losses)
        finally:
            trainer._step_tokens = saved
        total = torch.zeros((), dtype=torch.float64, device=trainer.device)
        for loss in losses:
            total += loss.double()
        return total
