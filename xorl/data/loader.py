"""Per-rank microbatches: deterministic, resumable, and the same global batch on every layout.

The global batch of step t is ``gradient_accumulation_steps × dp_size`` microbatches taken in a
fixed order from a seeded shuffle of the packed sequences; data-parallel rank d takes every
dp_size-th one. So every layout (and one process) sees the same tokens per optimizer step, which
is what makes loss parity across layouts possible.

The position is counted in sequences, not steps: a run resumed with another global batch (more
ranks, another micro batch or accumulation) continues at the first sequence the checkpoint had not
consumed, so every sequence is seen once. ``resume_at(step, consumed_sequences)`` sets it.
"""

from __future__ import annotations

import functools
import random

from xorl.data.corpus import DataError, builtin_documents, read_documents
from xorl.data.packing import PackedSequence, collate, pack_documents
from xorl.data.tokenizer import build_tokenizer


@functools.lru_cache(maxsize=4)
def _builtin_sequences(seed: int, seq_len: int, tokenizer: str, packing: bool) -> tuple[PackedSequence, ...]:
    """The built-in corpus packed, once per process and setting: it is generated, so the same
    arguments give the same sequences, and a process that builds several trainers (tests, the
    planner) packs it once. Nobody writes into a PackedSequence (collate copies)."""
    tok = build_tokenizer(tokenizer)
    docs = builtin_documents(seed=seed)
    return tuple(pack_documents((tok.encode(d) for d in docs), seq_len, tok.pad_id, packing=packing))


class PackedDataset:
    def __init__(self, data_config, vocab_size: int | None = None):
        self.tokenizer = build_tokenizer(data_config.tokenizer)
        if vocab_size is not None and self.tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}: "
                f"set --model.vocab_size={self.tokenizer.vocab_size} or more"
            )
        if data_config.dataset == "builtin":
            self.sequences: list[PackedSequence] = list(_builtin_sequences(
                data_config.seed, data_config.seq_len, data_config.tokenizer, data_config.packing))
        else:
            docs = read_documents(data_config.dataset, data_config.text_key)
            self.sequences = pack_documents(
                (self.tokenizer.encode(d) for d in docs), data_config.seq_len, self.tokenizer.pad_id,
                packing=data_config.packing,
            )
        if not self.sequences:
            raise DataError(f"data.dataset {data_config.dataset!r} produced no tokens")
        self.seed = data_config.seed

    def __len__(self) -> int:
        return len(self.sequences)

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.sequences)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx


class MicrobatchLoader:
    """Yields this rank's microbatches for a given optimizer step."""

    def __init__(self, dataset: PackedDataset, micro_batch_size: int, gradient_accumulation_steps: int,
                 dp_rank: int, dp_size: int):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.ga = gradient_accumulation_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._orders: dict[int, list[int]] = {}
        self._start_step, self._start_sequence = 0, 0

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over all data-parallel ranks."""
        return self.ga * self.dp_size * self.mbs

    def resume_at(self, step: int, consumed_sequences: int) -> None:
        """Step ``step`` starts at global sequence ``consumed_sequences`` (whatever the old batch was)."""
        self._start_step, self._start_sequence = step, consumed_sequences

    def first_sequence(self, step: int) -> int:
        """Global index of the first sequence of optimizer step ``step`` = sequences consumed before it."""
        return self._start_sequence + (step - self._start_step) * self.global_batch

    def _sequence(self, global_index: int) -> PackedSequence:
        n = len(self.dataset)
        epoch, i = divmod(global_index, n)
        if epoch not in self._orders:
            self._orders = {epoch: self.dataset.order(epoch)}
        return self.dataset.sequences[self._orders[epoch][i]]

    def microbatches(self, step: int) -> list[dict]:
        """The ``gradient_accumulation_steps`` microbatches of this rank for optimizer step ``step``."""
        out = []
        for m in range(self.ga):
            first = self.first_sequence(step) + (m * self.dp_size + self.dp_rank) * self.mbs
            out.append(collate([self._sequence(first + j) for j in range(self.mbs)]))
        return out
