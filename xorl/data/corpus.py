"""The built-in corpus (no download) and readers for local JSONL / text / parquet datasets.

Why a generated corpus: the default run must work on a machine with no network, and its loss
must fall visibly in a few hundred steps. Short sentences with arithmetic facts and a small
grammar give a byte-level model structure it can learn quickly, deterministically from a seed.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator

from xorl.data.errors import DataError
from xorl.data.hf_source import file_rows, is_saved_dataset, saved_dataset_rows

__all__ = ["DataError", "is_saved_dataset", "read_documents", "read_rows", "text_of"]

_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Leslie", "Radia"]
_OBJECTS = ["kernel", "tensor", "gradient", "pipeline", "expert", "ring", "mesh", "shard", "token", "layer"]
_VERBS = ["reads", "writes", "splits", "merges", "sends", "checks", "trains", "packs", "moves", "sorts"]


def builtin_documents(num_documents: int = 4000, seed: int = 0) -> list[str]:
    """A deterministic synthetic corpus of short documents of uneven length."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                a, b = rng.randint(0, 99), rng.randint(0, 99)
                sentences.append(f"{a} plus {b} is {a + b}.")
            else:
                sentences.append(
                    f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_OBJECTS)}"
                    f" and the {rng.choice(_OBJECTS)}."
                )
        docs.append(" ".join(sentences))
    return docs


# Read by xorl itself (errors name the file and line); the others through Hugging Face `datasets`.
READABLE_SUFFIXES = (".jsonl", ".txt", ".parquet")
DATASETS_SUFFIXES = (".json", ".csv", ".arrow")


class TextDocument(str):
    """A document that is text by nature (a .txt document, the built-in corpus), not a JSON row."""


def dataset_files(folder: str) -> list[str]:
    """The readable files of a dataset folder, in name order."""
    suffixes = READABLE_SUFFIXES + DATASETS_SUFFIXES
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(suffixes))


def read_rows(path: str, split: str | None = None, default_split: str = "train") -> Iterator[tuple[object, str]]:
    """(row, where) of a local file or folder: .jsonl objects, .txt documents (strings), .parquet
    rows (ours: errors name the file and line or row); .json / .csv / .arrow files and save_to_disk
    folders through ``datasets`` (xorl/data/hf_source.py; ``split``, else ``default_split``, picks a
    DatasetDict's part). ``where`` is ``file:line`` / ``file: row n``."""
    if is_saved_dataset(path):
        yield from saved_dataset_rows(path, split, default_split)
        return
    if os.path.isdir(path):
        files = dataset_files(path)
        if not files:
            raise DataError(f"data.dataset: no {'/'.join(READABLE_SUFFIXES + DATASETS_SUFFIXES)} files in {path!r}")
        for file in files:
            yield from read_rows(file)
        return
    if path.endswith(DATASETS_SUFFIXES) and os.path.isfile(path):
        yield from file_rows(path)
        return
    reader = _reader_for(path)
    if reader is None and not path.endswith(DATASETS_SUFFIXES):
        raise DataError(f"data.dataset: {path!r} is not {', '.join(READABLE_SUFFIXES + DATASETS_SUFFIXES)} "
                        "(or 'builtin')")
    if not os.path.isfile(path):
        raise DataError(f"data.dataset: {path!r} does not exist")
    yield from reader(path)


def read_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """The text documents of a local file or folder: .jsonl (one JSON object a line, ``text_key``),
    .txt (documents separated by blank lines), .parquet (column ``text_key``), and what read_rows reads.

    Every problem is a DataError naming the file and its 1-based line (row for parquet)."""
    if path.endswith(".parquet") and os.path.isfile(path):
        _parquet_columns(path, [text_key])  # a missing column is one error for the file, not one per row
    for row, where in read_rows(path):
        yield text_of(row, text_key, where)


def text_of(row, text_key: str, where) -> str:
    """A text row's document: a .txt document, or the row's ``text_key`` string."""
    if isinstance(row, TextDocument):
        return str(row)
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with key {text_key!r}, got a {_json_kind(row)}")
    if text_key not in row:
        raise DataError(f"{where}: no key {text_key!r} (keys: {sorted(row)}); set data.text_key")
    return _text(row[text_key], f"{where}: {text_key!r}")


def _reader_for(path: str):
    for ext, reader in ((".jsonl", _read_jsonl), (".txt", _read_text), (".parquet", _read_parquet)):
        if path.endswith(ext):
            return reader
    return None


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of a UTF-8 file; a DataError names the line that is not UTF-8."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "convert the file to UTF-8"
                ) from None


def _read_jsonl(path: str) -> Iterator[tuple[object, str]]:
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON: {e.msg} (column {e.colno})") from None
        yield row, f"{path}:{line_no}"


def _read_text(path: str) -> Iterator[tuple[str, str]]:
    doc: list[str] = []
    first = 0
    for line_no, line in _lines(path):
        if line.strip():
            first = first or line_no
            doc.append(line.rstrip("\n"))
        elif doc:
            yield TextDocument("\n".join(doc)), f"{path}:{first}"
            doc, first = [], 0
    if doc:
        yield TextDocument("\n".join(doc)), f"{path}:{first}"


def _parquet_columns(path: str, needed: list[str]) -> list[str]:
    """The file's columns; a DataError (one line) when it cannot be read or lacks one of ``needed``."""
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from err
    try:
        # The schema first: pyarrow's own error for a missing column appends the whole schema.
        columns = pq.read_schema(path).names
    except (OSError, KeyError, ValueError) as e:  # pyarrow's errors derive from these
        raise DataError(f"{path}: cannot read column {needed[0]!r}: {_first_line(e)}") from None
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {columns}); set data.text_key")
    return columns


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _read_parquet(path: str) -> Iterator[tuple[dict, str]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: cannot read it: {_first_line(e)}") from None
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024):  # bounded memory for large files
            for record in batch.to_pylist():
                yield record, f"{path}: row {row}"
                row += 1
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: cannot read row {row}: {_first_line(e)}") from None


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where} is {_json_kind(value)}, expected a string")
    return value


def _json_kind(value) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
             list: "list", dict: "object"}
    return names.get(type(value), type(value).__name__)
