"""Document packing: fixed-length sequences with per-document position ids and boundaries.

A document is its token ids and, for the supervised formats, its labels (Hugging Face's convention:
aligned with the ids, -100 where a token is not a target; ``None``: every token is one). The
labels a sequence carries are the next token's label within the same document (-100 at a document's
end and in padding), computed before any sharding, so they stay right across every later split
(pipeline microbatches, context-parallel shards) and reach every loss path (plain, fused linear CE,
vocabulary-parallel) as ignore_index: a masked token never counts in the loss or its normalisation.

Two ways to fill a sequence (``whole_documents``):
- text (pretraining): a document longer than what is left in a sequence continues in the next one
  as a new piece (position ids restart); nothing is dropped.
- the supervised formats: a document starts a new sequence when it does not fit in what is left
  (the rest is padding), so a conversation is never cut at a sequence boundary. A document longer
  than seq_len is cut into seq_len pieces as text is (positions restart); a piece with no target
  (all masked) is left out. Both are counted (``DataCounts``) and reported in the log.
The last, short sequence is padded, and padding never counts in the loss.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100

# (token ids, labels): labels None means every token is a target (text).
Document = tuple[list[int], "list[int] | None"]


@dataclass
class PackedSequence:
    input_ids: torch.Tensor  # [seq_len] int64
    labels: torch.Tensor  # [seq_len] int64, IGNORE_INDEX where no target
    position_ids: torch.Tensor  # [seq_len] int64, restarting at 0 for every document piece
    doc_lengths: list[int]  # lengths of the document pieces (and the padding piece), summing to seq_len


@dataclass
class DataCounts:
    """What reading and packing left out or cut, for the one log line (``summary``)."""

    rows: int = 0  # rows read
    untrained_rows: int = 0  # rows with no target token (all masked, or too short): left out
    split_rows: int = 0  # supervised rows longer than seq_len, cut into pieces
    untrained_pieces: int = 0  # pieces of those with no target token: left out

    def summary(self, seq_len: int) -> str | None:
        parts = []
        if self.untrained_rows:
            parts.append(f"{self.untrained_rows} of {self.rows} rows train on no token (all masked or empty) "
                         "and are left out")
        if self.split_rows:
            parts.append(f"{self.split_rows} rows are longer than data.seq_len={seq_len} and are cut into pieces of "
                         "seq_len tokens (positions restart in each piece, which sees none of the text before it: "
                         "raise data.seq_len to keep them whole)"
                         + (f", {self.untrained_pieces} pieces with no trained token left out"
                            if self.untrained_pieces else ""))
        return "; ".join(parts) or None


def trains_on_something(doc: Document) -> bool:
    """Whether a document has at least one target token (a label on a token after the first)."""
    ids, labels = doc
    if labels is None:
        return len(ids) >= 2
    return any(label != IGNORE_INDEX for label in labels[1:])


class Packer:
    """Fills sequences of exactly ``seq_len`` tokens from documents, one sequence at a time.

    ``carry`` is the part of a document not placed yet (the rest of a cut one, or, with
    ``whole_documents``, one that did not fit): the only state between sequences, which a streamed
    loader saves with each checkpoint.
    """

    def __init__(self, seq_len: int, pad_id: int, packing: bool = True, whole_documents: bool = False,
                 counts: DataCounts | None = None):
        if seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.packing, self.whole = packing, whole_documents
        self.counts = counts if counts is not None else DataCounts()
        self.carry: Document | None = None
        self.carry_is_piece = False  # the carry is the rest of a cut document (counted once)

    def next_sequence(self, next_document: Callable[[], Document | None]):
        """(ids, targets, positions, piece lengths) of the next sequence, padded; None when the
        documents are exhausted and nothing is pending."""
        seq_len = self.seq_len
        ids: list[int] = []
        targets: list[int] = []
        pos: list[int] = []
        lengths: list[int] = []
        while len(ids) < seq_len:
            if ids and not self.packing:
                break
            doc, piece = self.carry, self.carry_is_piece
            self.carry, self.carry_is_piece = None, False
            if doc is None:
                doc = next_document()
                if doc is None:
                    break
            doc_ids, doc_labels = doc
            if not doc_ids:
                continue
            room = seq_len - len(ids)
            if self.whole and ids and len(doc_ids) > room:  # start it in the next sequence
                self.carry, self.carry_is_piece = doc, piece
                break
            take = min(len(doc_ids), room)
            source = doc_ids if doc_labels is None else doc_labels
            piece_targets = source[1:take + 1] + ([IGNORE_INDEX] if take == len(doc_ids) else [])
            if take < len(doc_ids):
                self.carry = (doc_ids[take:], None if doc_labels is None else doc_labels[take:])
                self.carry_is_piece = True
                if self.whole and not piece:
                    self.counts.split_rows += 1
            if self.whole and (piece or take < len(doc_ids)) and \
                    all(t == IGNORE_INDEX for t in piece_targets):
                self.counts.untrained_pieces += 1
                continue
            ids += doc_ids[:take]
            targets += piece_targets
            pos += range(take)
            lengths.append(take)
        if not ids:
            return None
        pad = seq_len - len(ids)
        if pad:
            ids += [self.pad_id] * pad
            targets += [IGNORE_INDEX] * pad
            pos += range(pad)
            lengths.append(pad)
        return ids, targets, pos, lengths


def _as_document(doc) -> Document:
    return (doc, None) if isinstance(doc, list) else doc


def pack_documents(token_docs: Iterable, seq_len: int, pad_id: int, packing: bool = True,
                   whole_documents: bool = False, counts: DataCounts | None = None) -> list[PackedSequence]:
    """Pack documents (token-id lists, or ``(ids, labels)`` Documents) into sequences of exactly
    ``seq_len`` tokens (the module docstring's rules).

    With ``packing=False`` every document starts a new sequence (its pieces still fill whole
    sequences; the last one is padded).
    """
    packer = Packer(seq_len, pad_id, packing, whole_documents, counts)
    docs = iter(token_docs)

    def next_document() -> Document | None:
        doc = next(docs, None)
        return None if doc is None else _as_document(doc)

    # Every sequence's tokens go into flat lists, made into one tensor per field at the end: one
    # torch.tensor call per sequence and field cost most of a trainer's start-up on small models.
    flat_ids: list[int] = []
    flat_labels: list[int] = []
    flat_pos: list[int] = []
    doc_lengths: list[list[int]] = []
    while (parts := packer.next_sequence(next_document)) is not None:
        ids, targets, pos, lengths = parts
        flat_ids += ids
        flat_labels += targets
        flat_pos += pos
        doc_lengths.append(lengths)
    if not doc_lengths:
        return []
    # array -> frombuffer: torch.tensor(list) converts element by element, ~10x slower.
    rows = [torch.frombuffer(array("q", flat), dtype=torch.int64).view(-1, seq_len).unbind(0)
            for flat in (flat_ids, flat_labels, flat_pos)]
    return [PackedSequence(i, t, p, n) for i, t, p, n in zip(*rows, doc_lengths)]


def to_packed_sequence(parts) -> PackedSequence:
    """A PackedSequence from ``Packer.next_sequence``'s lists."""
    ids, targets, pos, lengths = parts
    return PackedSequence(torch.tensor(ids), torch.tensor(targets), torch.tensor(pos), lengths)


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
