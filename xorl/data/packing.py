"""Document packing: fixed-length sequences with per-document position ids and boundaries.

Labels are the next token of the same document (-100 where there is none: at a document's end
and in padding), computed before any sharding, so they stay right across every later split
(pipeline microbatches, context-parallel shards). A document longer than what is left in a
sequence continues in the next one as a new piece (position ids restart); nothing is dropped:
the last, short sequence is padded, and padding never counts in the loss.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class PackedSequence:
    input_ids: torch.Tensor  # [seq_len] int64
    labels: torch.Tensor  # [seq_len] int64, IGNORE_INDEX where no target
    position_ids: torch.Tensor  # [seq_len] int64, restarting at 0 for every document piece
    doc_lengths: list[int]  # lengths of the document pieces (and the padding piece), summing to seq_len


def pack_documents(token_docs: Iterable[list[int]], seq_len: int, pad_id: int,
                   packing: bool = True) -> list[PackedSequence]:
    """Pack tokenised documents into sequences of exactly ``seq_len`` tokens.

    With ``packing=False`` every document starts a new sequence (its pieces still fill whole
    sequences; the last one is padded).
    """
    if seq_len < 2:
        raise ValueError(f"data.seq_len must be >= 2, got {seq_len}")
    # Every sequence's tokens go into flat lists, made into one tensor per field at the end: one
    # torch.tensor call per sequence and field cost most of a trainer's start-up on small models.
    flat_ids: list[int] = []
    flat_labels: list[int] = []
    flat_pos: list[int] = []
    doc_lengths: list[list[int]] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    lengths: list[int] = []

    def flush() -> None:
        if not ids:
            return
        pad = seq_len - len(ids)
        if pad:
            ids.extend([pad_id] * pad)
            labels.extend([IGNORE_INDEX] * pad)
            pos.extend(range(pad))
            lengths.append(pad)
        flat_ids.extend(ids), flat_labels.extend(labels), flat_pos.extend(pos)
        doc_lengths.append(list(lengths))
        ids.clear(), labels.clear(), pos.clear(), lengths.clear()

    for doc in token_docs:
        if not doc:
            continue
        targets = list(doc[1:]) + [IGNORE_INDEX]
        start = 0
        if not packing:
            flush()
        while start < len(doc):
            take = min(len(doc) - start, seq_len - len(ids))
            ids.extend(doc[start:start + take])
            labels.extend(targets[start:start + take])
            pos.extend(range(take))
            lengths.append(take)
            start += take
            if len(ids) == seq_len:
                flush()
    flush()
    if not doc_lengths:
        return []
    # array -> frombuffer: torch.tensor(list) converts element by element, ~10x slower.
    rows = [torch.frombuffer(array("q", flat), dtype=torch.int64).view(-1, seq_len).unbind(0)
            for flat in (flat_ids, flat_labels, flat_pos)]
    return [PackedSequence(i, t, p, n) for i, t, p, n in zip(*rows, doc_lengths)]


def collate(sequences: list[PackedSequence]) -> dict[str, torch.Tensor]:
    """Concatenate sequences into one packed row [1, n*seq_len] with global ``cu_seqlens``."""
    lengths = [n for s in sequences for n in s.doc_lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return {
        "input_ids": torch.cat([s.input_ids for s in sequences])[None],
        "labels": torch.cat([s.labels for s in sequences])[None],
        "position_ids": torch.cat([s.position_ids for s in sequences])[None],
        "cu_seqlens": cu,
        "max_seqlen": int(max(lengths)),
    }
