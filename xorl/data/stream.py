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

Sources: local .jsonl / .txt files (and folders of them) are read by xorl, from a byte offset;
everything else (a .parquet / .json / .csv / .arrow file, a save_to_disk folder, a hub name) is a
``datasets`` IterableDataset, whose own ``state_dict`` says where it stands. Rows of every format
(xorl/data/formats.py) are encoded and packed by the same code as in memory (``Packer``).

Resuming: ``state()`` is where the stream stands after the last full step (file and byte offset of
the next row, or the IterableDataset's state; the part of a document not placed yet; epoch;
sequences produced); the trainer stores it with each checkpoint, and ``restore()`` continues from
it on any number of ranks.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator

from xorl.data.corpus import DataError, TextDocument, builtin_documents, dataset_files, is_saved_dataset, text_of
from xorl.data.formats import RowEncoder
from xorl.data.packing import DataCounts, Document, Packer, collate, to_packed_sequence

STREAM_SUFFIXES = (".jsonl", ".txt")  # streamed by xorl from a byte offset; the rest through datasets


def streams_through_datasets(dataset: str) -> bool:
    """Whether ``data.dataset`` streams as a datasets IterableDataset (not xorl's own file reader)."""
    if dataset == "builtin":
        return False
    if not os.path.exists(dataset):
        return True  # a hub name
    return is_saved_dataset(dataset) or (os.path.isfile(dataset) and not dataset.endswith(STREAM_SUFFIXES))


def stream_files(dataset: str) -> list[str]:
    if dataset == "builtin":
        return ["builtin"]
    files = dataset_files(dataset) if os.path.isdir(dataset) else [dataset]
    bad = [f for f in files if not f.endswith(STREAM_SUFFIXES)]
    if bad or not files:
        raise DataError(
            f"data.streaming reads a folder of {'/'.join(STREAM_SUFFIXES)} files, or one file datasets reads; "
            f"{bad or dataset!r} cannot be streamed from a folder (stream each file, or data.streaming: false)"
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


class _LineAt:
    """``path:LINE`` of the line starting at byte ``offset``, counted only when an error prints it."""

    def __init__(self, path: str, offset: int):
        self.path, self.offset = path, offset

    def __str__(self) -> str:
        return _line_at(self.path, self.offset)


def _rows_from(path: str, offset: int, seed: int) -> Iterator[tuple[object, object, int]]:
    """(row, where, byte offset just after it) from ``offset`` on; the builtin corpus counts documents."""
    if path == "builtin":
        docs = builtin_documents(seed=seed)
        for i in range(offset, len(docs)):
            yield TextDocument(docs[i]), f"builtin document {i}", i + 1
        return
    with open(path, "rb") as f:
        f.seek(offset)
        pending: list[str] = []
        pending_at = offset
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
                yield row, _LineAt(path, offset - len(raw)), offset
            elif line.strip():  # .txt: documents separated by blank lines
                if not pending:
                    pending_at = offset - len(raw)
                pending.append(line.rstrip("\n"))
            elif pending:
                yield TextDocument("\n".join(pending)), _LineAt(path, pending_at), offset
                pending = []
        if pending:
            yield TextDocument("\n".join(pending)), _LineAt(path, pending_at), offset


def _documents_from(path: str, offset: int, text_key: str, seed: int) -> Iterator[tuple[str, int]]:
    """(text document, byte offset just after it) from ``offset`` on."""
    for row, where, end in _rows_from(path, offset, seed):
        yield text_of(row, text_key, where), end


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
                 dp_rank: int, dp_size: int, vocab_size: int | None = None):
        self.dataset, self.seed = data_config.dataset, data_config.seed
        self.through_datasets = streams_through_datasets(self.dataset)
        self.tokenizer = tokenizer
        self.counts = DataCounts()
        self.encoder = RowEncoder(data_config, tokenizer, self.counts, vocab_size)
        self.mbs, self.ga = micro_batch_size, gradient_accumulation_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._state = {"epoch": 0, "file": 0, "offset": 0, "row": 0, "sequences": 0}
        self._start_step, self._start_sequence = 0, 0
        self._rows: Iterator | None = None
        if self.through_datasets:
            from xorl.data.hf_source import load

            self.files = []
            self._hf = load(self.dataset, data_config.split, streaming=True)
            self._hf_start = copy.deepcopy(self._hf.state_dict())
            self._state["hf"] = copy.deepcopy(self._hf_start)
        else:
            self.files = stream_files(self.dataset)
        # The format (auto: the first row's) decides how documents pack, before the first sequence.
        start = copy.deepcopy(self._state)
        first = next(self._open_rows(), None)
        self._state = start  # the peek consumed nothing
        if first is None:
            raise DataError(f"data.dataset={self.dataset!r} holds no row; there is nothing to stream")
        self.encoder.resolve(first[0], first[1])
        self._rows = None
        self.packer = Packer(data_config.seq_len, tokenizer.pad_id, data_config.packing,
                             whole_documents=self.encoder.supervised, counts=self.counts)

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
        state = copy.deepcopy(self._state)
        if self.through_datasets:
            state["hf"] = copy.deepcopy(self._hf.state_dict()) if self._rows is not None else state["hf"]
        carry = self.packer.carry
        state["carry"] = list(carry[0]) if carry else []
        state["carry_labels"] = list(carry[1]) if carry and carry[1] is not None else None
        state["carry_is_piece"] = self.packer.carry_is_piece
        return state

    def restore(self, state: dict) -> None:
        self._state = {key: int(state.get(key, 0)) for key in ("epoch", "file", "offset", "row", "sequences")}
        if self.through_datasets:
            if "hf" not in state:
                raise DataError("data.streaming: the checkpoint's stream position is of xorl's file reader, not of "
                                f"a datasets stream of {self.dataset!r}; resume with the data it was trained with")
            self._state["hf"] = copy.deepcopy(state["hf"])
        carry = [int(t) for t in state.get("carry", [])]
        labels = state.get("carry_labels")
        self.packer.carry = (carry, None if labels is None else [int(t) for t in labels]) if carry else None
        self.packer.carry_is_piece = bool(state.get("carry_is_piece", bool(carry)))
        self._rows = None

    def _open_rows(self) -> Iterator[tuple[object, object]]:
        """Rows from where the stream stands to the end of the epoch; advances the state's cursor."""
        s = self._state
        if self.through_datasets:
            self._hf.load_state_dict(copy.deepcopy(s["hf"]))
            for row in self._hf:
                s["row"] += 1
                yield row, f"{self.dataset} row {s['row'] - 1}"
            return
        while s["file"] < len(self.files):
            for row, where, end in _rows_from(self.files[s["file"]], s["offset"], self.seed):
                s["offset"] = end
                yield row, where
            s["file"], s["offset"] = s["file"] + 1, 0

    def _next_document(self) -> Document:
        """The next document that trains on something; goes round the data as often as needed."""
        passes = 0  # passes to the end of the data without a document (the first may start mid-way)
        while True:
            if self._rows is None:
                self._rows = self._open_rows()
            for row, where in self._rows:
                doc = self.encoder.encode(row, where)
                if doc is not None:
                    return doc
            self._rows = None
            passes += 1
            if passes > 1:
                raise DataError(f"data.streaming: no row of {self.dataset!r} has any token to train on "
                                f"({self.counts.untrained_rows} rows train on no token)")
            s = self._state
            s["file"], s["offset"], s["row"], s["epoch"] = 0, 0, 0, s["epoch"] + 1
            if self.through_datasets:
                s["hf"] = copy.deepcopy(self._hf_start)

    def _next_sequence(self):
        parts = self.packer.next_sequence(self._next_document)
        self._state["sequences"] += 1
        return to_packed_sequence(parts)

    def microbatches(self, step: int) -> list[dict]:
        first = self.first_sequence(step)
        if self._state["sequences"] != first:
            raise RuntimeError(
                f"streamed data is at sequence {self._state['sequences']} but step {step} starts at {first}: "
                "steps must be read in order"
            )
        mine: dict[int, list] = {m: [] for m in range(self.ga)}
        for i in range(self.global_batch):
            seq = self._next_sequence()
            m, rest = divmod(i // self.mbs, self.dp_size)
            if rest == self.dp_rank:
                mine[m].append(seq)
        return [collate(mine[m]) for m in range(self.ga)]
