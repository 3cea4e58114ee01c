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


READABLE_SUFFIXES = (".jsonl", ".txt", ".parquet")


class DataError(ValueError):
    """A dataset file that cannot be read as documents; the message names the file and the line."""


def dataset_files(folder: str) -> list[str]:
    """The readable files of a dataset folder, in name order."""
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(READABLE_SUFFIXES))


def read_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """Documents from a local file or folder: .jsonl (one JSON object a line, ``text_key``),
    .txt (documents separated by blank lines), .parquet (column ``text_key``).

    Every problem is a DataError naming the file and its 1-based line (row for parquet)."""
    if os.path.isdir(path):
        files = dataset_files(path)
        if not files:
            raise DataError(f"data.dataset: no {'/'.join(READABLE_SUFFIXES)} files in {path!r}")
        for file in files:
            yield from read_documents(file, text_key)
        return
    reader = _reader_for(path)
    if reader is None:
        raise DataError(f"data.dataset: {path!r} is not {', '.join(READABLE_SUFFIXES)} (or 'builtin')")
    if not os.path.isfile(path):
        raise DataError(f"data.dataset: {path!r} does not exist")
    yield from reader(path, text_key)


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


def _read_jsonl(path: str, text_key: str) -> Iterator[str]:
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{path}:{line_no}: expected a JSON object with key {text_key!r}, got a {_json_kind(row)}"
            )
        if text_key not in row:
            raise DataError(f"{path}:{line_no}: no key {text_key!r} (keys: {sorted(row)}); set data.text_key")
        yield _text(row[text_key], f"{path}:{line_no}: {text_key!r}")


def _read_text(path: str, text_key: str) -> Iterator[str]:
    doc: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            doc.append(line.rstrip("\n"))
        elif doc:
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)


def _read_parquet(path: str, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from err
    try:
        # The schema first: pyarrow's own error for a missing column appends the whole schema.
        columns = pq.read_schema(path).names
        table = pq.read_table(path, columns=[text_key]) if text_key in columns else None
    except (OSError, KeyError, ValueError) as e:  # pyarrow's errors derive from these
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: cannot read column {text_key!r}: {first_line}") from None
    if table is None:
        raise DataError(f"{path}: no column {text_key!r} (columns: {columns}); set data.text_key")
    for row, value in enumerate(table.column(text_key).to_pylist()):
        yield _text(value, f"{path}: row {row} {text_key!r}")


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where} is {_json_kind(value)}, expected a string")
    return value


def _json_kind(value) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
             list: "list", dict: "object"}
    return names.get(type(value), type(value).__name__)
