"""Streamed data (``data.streaming: true``): documents read, tokenised and packed as training goes.

Why: the in-memory dataset (xorl/data/loader.py) tokenises the whole corpus on every rank before
the first step and shuffles all packed sequences; a 10 GB JSONL would take minutes and gigabytes
per rank. Here each rank reads the files in order from where the stream stands, tokenises one
document at a time and packs it exactly as ``pack_documents`` does (the same sequences, in file
order), keeping only the sequences that are its own: global sequence ``i`` of step ``t`` goes to
data rank ``(i - first(t)) // micro_batch % dp`` (the in-memory loader's rule). Memory is the
document being packed and the step's own sequences; start-up reads only what the first step needs.

The order is the files' order (no global shuffle: a streamed corpus is usually shuffled when it is
written). Every layout reads the same stream, so every layout sees the same global batch per step,
as one process does. After the last file the stream starts over (the next epoch).

Resuming: ``state()`` is where the stream stands after the last full step (file, byte offset of the
next document, the rest of a document split across sequences, epoch, sequences produced); the
trainer stores it with each checkpoint, and ``restore()`` continues from it on any number of ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from xorl.data.corpus import DataError, _text, builtin_documents, dataset_files
from xorl.data.packing import IGNORE_INDEX, PackedSequence, collate

STREAM_SUFFIXES = (".jsonl", ".txt")


def stream_files(dataset: str) -> list[str]:
    if dataset == "builtin":
        return ["builtin"]
    files = dataset_files(dataset) if os.path.isdir(dataset) else [dataset]
    bad = [f for f in files if not f.endswith(STREAM_SUFFIXES)]
    if bad or not files:
        raise DataError(
            f"data.streaming reads {'/'.join(STREAM_SUFFIXES)} files; {bad or dataset!r} cannot be streamed "
            "(use data.streaming: false for parquet, or convert it to JSONL)"
        )
    if not any(_has_text(f) for f in files):  # the stream would go round its files forever
        shown = files[0] if len(files) == 1 else f"none of its {len(files)} files ({', '.join(files[:3])}, ...)"
        raise DataError(f"data.dataset={dataset!r}: {shown} holds no document (it is empty or has only blank "
                        "lines); there is nothing to stream")
    return files


def _has_text(path: str) -> bool:
    """Whether the file has a non-blank line (reads up to the first one)."""
    with open(path, "rb") as f:
        return any(line.strip() for line in f)


def _documents_from(path: str, offset: int, text_key: str, seed: int) -> Iterator[tuple[str, int]]:
    """(document, byte offset just after it) from ``offset`` on; the builtin corpus counts documents."""
    if path == "builtin":
        docs = builtin_documents(seed=seed)
        for i in range(offset, len(docs)):
            yield docs[i], i + 1
        return
    with open(path, "rb") as f:
        f.seek(offset)
        pending: list[str] = []
        line_no = None
        while True:
            raw = f.readline()
            if not raw:
                break
            offset += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{_line_at(path, offset - len(raw))}: not UTF-8 text ({e.reason})") from None
            if path.endswith(".jsonl"):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{_line_at(path, offset - len(raw))}: not valid JSON: {e.msg}") from None
                if not isinstance(row, dict) or text_key not in row:
                    raise DataError(f"{_line_at(path, offset - len(raw))}: expected an object with key "
                                    f"{text_key!r}; set data.text_key")
                text = row[text_key]
                if not isinstance(text, str):  # raises, naming the line (counted only then)
                    _text(text, f"{_line_at(path, offset - len(raw))}: {text_key!r}")
                yield text, offset
            elif line.strip():  # .txt: documents separated by blank lines
                pending.append(line.rstrip("\n"))
            elif pending:
                yield "\n".join(pending), offset
                pending = []
        del line_no
        if pending:
            yield "\n".join(pending), offset


def _line_at(path: str, offset: int) -> str:
    """``path:LINE`` of the line starting at byte ``offset`` (as the in-memory reader names it). Counted
    only when an error is reported, so the stream keeps no line count (its state is a byte offset)."""
    lines = 0
    with open(path, "rb") as f:
        while offset > 0:  # in 1 MiB pieces: the file may be far larger than memory
            piece = f.read(min(offset, 1 << 20))
            if not piece:
                break
            lines, offset = lines + piece.count(b"\n"), offset - len(piece)
    return f"{path}:{lines + 1}"


class StreamedLoader:
    """The MicrobatchLoader interface over a streamed corpus; steps must be asked for in order."""

    def __init__(self, data_config, tokenizer, micro_batch_size: int, gradient_accumulation_steps: int,
                 dp_rank: int, dp_size: int):
        self.files = stream_files(data_config.dataset)
        self.text_key, self.seed = data_config.text_key, data_config.seed
        self.seq_len, self.packing = data_config.seq_len, data_config.packing
        self.tokenizer = tokenizer
        self.mbs, self.ga = micro_batch_size, gradient_accumulation_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._state = {"epoch": 0, "file": 0, "offset": 0, "carry": [], "sequences": 0}
        self._start_step, self._start_sequence = 0, 0
        self._docs: Iterator | None = None

    @property
    def global_batch(self) -> int:
        return self.ga * self.dp_size * self.mbs

    def first_sequence(self, step: int) -> int:
        return self._start_sequence + (step - self._start_step) * self.global_batch

    def resume_at(self, step: int, consumed_sequences: int, state: dict | None = None) -> None:
        if state is None or int(state.get("sequences", -1)) != consumed_sequences:
            raise DataError(
                f"data.streaming: the checkpoint holds no stream position for sequence {consumed_sequences}; "
                "resume it with the data settings it was trained with"
            )
        self._start_step, self._start_sequence = step, consumed_sequences
        self.restore(state)

    def state(self) -> dict:
        """Where the stream stands: JSON-serialisable, the same on every rank after a step."""
        return {**self._state, "carry": list(self._state["carry"])}

    def restore(self, state: dict) -> None:
        self._state = {"epoch": int(state["epoch"]), "file": int(state["file"]), "offset": int(state["offset"]),
                       "carry": [int(t) for t in state["carry"]], "sequences": int(state["sequences"])}
        self._docs = None

    def _next_document(self) -> list[int]:
        """The next document's tokens (the rest of a split one first); advances the file cursor."""
        s = self._state
        if s["carry"]:
            doc, s["carry"] = s["carry"], []
            return doc
        empty_files = 0  # files in a row that gave no token: a whole round of them would loop forever
        while True:
            if self._docs is None:
                self._docs = _documents_from(self.files[s["file"]], s["offset"], self.text_key, self.seed)
            for text, end in self._docs:
                s["offset"] = end
                tokens = self.tokenizer.encode(text)
                if tokens:
                    return tokens
            self._docs = None
            empty_files += 1
            if empty_files > len(self.files):
                raise DataError(f"data.streaming: no document of {', '.join(self.files[:3])}"
                                f"{', ...' if len(self.files) > 3 else ''} has any token (every text is empty)")
            s["file"], s["offset"] = s["file"] + 1, 0
            if s["file"] == len(self.files):
                s["file"], s["epoch"] = 0, s["epoch"] + 1

    def _next_sequence(self) -> PackedSequence:
        """One packed sequence of exactly seq_len tokens (pack_documents' rule, one at a time)."""
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        lengths: list[int] = []
        while len(ids) < self.seq_len:
            if ids and not self.packing:
                break
            doc = self._next_document()
            take = min(len(doc), self.seq_len - len(ids))
            piece = doc[:take]
            ids += piece
            labels += doc[1:take + 1] + ([IGNORE_INDEX] if take == len(doc) else [])
            pos += range(take)
            lengths.append(take)
            if take < len(doc):
                self._state["carry"] = doc[take:]
        pad = self.seq_len - len(ids)
        if pad:
            ids += [self.tokenizer.pad_id] * pad
            labels += [IGNORE_INDEX] * pad
            pos += range(pad)
            lengths.append(pad)
        self._state["sequences"] += 1
        import torch

        return PackedSequence(torch.tensor(ids), torch.tensor(labels), torch.tensor(pos), lengths)

    def microbatches(self, step: int) -> list[dict]:
        first = self.first_sequence(step)
        if self._state["sequences"] != first:
            raise RuntimeError(
                f"streamed data is at sequence {self._state['sequences']} but step {step} starts at {first}: "
                "steps must be read in order"
            )
        mine: dict[int, list[PackedSequence]] = {m: [] for m in range(self.ga)}
        for i in range(self.global_batch):
            seq = self._next_sequence()
            m, rest = divmod(i // self.mbs, self.dp_size)
            if rest == self.dp_rank:
                mine[m].append(seq)
        return [collate(mine[m]) for m in range(self.ga)]
