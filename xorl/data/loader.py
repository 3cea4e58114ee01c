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
import hashlib
import itertools
import json
import os
import random
from collections.abc import Iterator

from xorl.data.corpus import DataError, TextDocument, builtin_documents, read_rows
from xorl.data.formats import RowEncoder
from xorl.data.packing import DataCounts, PackedSequence, collate, pack_documents
from xorl.data.tokenizer import build_tokenizer


@functools.lru_cache(maxsize=4)
def _builtin_sequences(seed: int, seq_len: int, tokenizer: str, packing: bool) -> tuple[PackedSequence, ...]:
    """The built-in corpus packed, once per process and setting: it is generated, so the same
    arguments give the same sequences, and a process that builds several trainers (tests, the
    planner) packs it once. Nobody writes into a PackedSequence (collate copies)."""
    tok = build_tokenizer(tokenizer)
    docs = builtin_documents(seed=seed)
    return tuple(pack_documents((tok.encode(d) for d in docs), seq_len, tok.pad_id, packing=packing))


def source_rows(dataset: str, split: str | None, seed: int,
                default_split: str = "train") -> Iterator[tuple[object, str]]:
    """(row, where) of ``data.dataset`` (or ``data.eval_dataset``): the built-in corpus, a local file or
    folder (xorl/data/corpus.py), or a Hugging Face hub name (xorl/data/hf_source.py)."""
    if dataset == "builtin":
        for i, doc in enumerate(builtin_documents(seed=seed)):
            yield TextDocument(doc), f"builtin document {i}"
    elif os.path.exists(dataset):
        yield from read_rows(dataset, split, default_split)
    else:
        from xorl.data.hf_source import hub_rows

        yield from hub_rows(dataset, split, default_split)


def held_out(row, fraction: float, seed: int) -> bool:
    """Whether ``data.eval_fraction`` holds this row out of training, for evaluation.

    Decided by a hash of the row's content (and the seed), not its position: the same rows are held
    out on every layout, in every epoch and after any resume, and a row repeated in the data is
    held out with its copies (the eval set never holds a row also trained on)."""
    if fraction <= 0:
        return False
    text = row if isinstance(row, str) else json.dumps(row, sort_keys=True, default=str)
    digest = hashlib.blake2b(f"{seed}\x00{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


class PackedDataset:
    """The packed sequences of the training data (``part='train'``) or of the eval set (``'eval'``:
    ``data.eval_dataset``, or the rows ``data.eval_fraction`` holds out; in file order)."""

    def __init__(self, data_config, vocab_size: int | None = None, part: str = "train"):
        self.tokenizer = build_tokenizer(data_config.tokenizer)
        if vocab_size is not None and self.tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}: "
                f"set --model.vocab_size={self.tokenizer.vocab_size} or more"
            )
        self.counts = DataCounts()
        self.encoder = RowEncoder(data_config, self.tokenizer, self.counts, vocab_size)
        self.seq_len = data_config.seq_len
        self.part = part
        source = data_config.dataset
        fraction = data_config.eval_fraction
        if part == "eval" and data_config.eval_dataset is not None:
            source, fraction = data_config.eval_dataset, 0.0
        self.source = source if not fraction else (
            f"{source} ({'the' if part == 'eval' else 'without the'} data.eval_fraction={fraction} held out)")
        builtin_text = data_config.format in ("auto", "text") and not fraction
        if source == "builtin" and builtin_text and part == "train":
            self.encoder.format = "text"
            self.sequences: list[PackedSequence] = list(_builtin_sequences(
                data_config.seed, data_config.seq_len, data_config.tokenizer, data_config.packing))
        else:
            own_eval = part == "eval" and data_config.eval_dataset is not None
            split = data_config.eval_split if own_eval else data_config.split
            # an eval dataset's own split defaults to 'validation' (hub datasets, DatasetDicts)
            rows = source_rows(source, split, data_config.seed, "validation" if own_eval else "train")
            if fraction:
                keep_eval = part == "eval"
                rows = ((row, where) for row, where in rows if held_out(row, fraction, data_config.seed) == keep_eval)
            first = next(rows, None)
            if first is None:
                raise DataError(f"data.{'eval_' if source is not data_config.dataset else ''}dataset {source!r} "
                                f"{'holds no row' if not fraction else f'leaves no row for {part}'}"
                                + ("; raise data.eval_fraction" if fraction and part == "eval" else ""))
            self.encoder.resolve(*first)
            docs = (self.encoder.encode(row, where) for row, where in itertools.chain([first], rows))
            self.sequences = pack_documents((d for d in docs if d is not None), data_config.seq_len,
                                            self.tokenizer.pad_id, packing=data_config.packing,
                                            whole_documents=self.encoder.supervised, counts=self.counts)
        if not self.sequences:
            raise DataError(f"data.{'eval_' if part == 'eval' else ''}dataset {source!r} produced no tokens"
                            + ("" if not self.counts.untrained_rows else
                               f" that train ({self.counts.untrained_rows} rows train on no token)"))
        self.seed = data_config.seed

    def report(self) -> list[str]:
        """The log lines about this data: its format, and what was left out or cut (when anything was)."""
        name = "eval data" if self.part == "eval" else "data"
        lines = [f"xorl: {name}: {self.source}, format {self.encoder.describe()}, {len(self)} sequences"
                 + (f" from {self.counts.rows} rows" if self.counts.rows else "")]
        summary = self.counts.summary(self.seq_len)
        if summary:
            lines.append(f"xorl: {name}: {summary}")
        return lines

    def __len__(self) -> int:
        return len(self.sequences)

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.sequences)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx


def data_report(loader) -> list[str]:
    """The log lines about the training data: its format and what was left out or cut."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, PackedDataset):
        return dataset.report()
    return [f"xorl: data: {loader.dataset}, streamed, format {loader.encoder.describe()}"]


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
