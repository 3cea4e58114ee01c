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


def read_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """Documents from a local file or folder: .jsonl (one JSON object a line, ``text_key``),
    .txt (documents separated by blank lines), .parquet (column ``text_key``)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if _reader_for(f) is not None)
        if not files:
            raise FileNotFoundError(f"data.dataset: no .jsonl/.txt/.parquet files in {path!r}")
        for file in files:
            yield from read_documents(file, text_key)
        return
    reader = _reader_for(path)
    if reader is None:
        raise ValueError(f"data.dataset: {path!r} is not .jsonl, .txt or .parquet (or 'builtin')")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.dataset: {path!r} does not exist")
    yield from reader(path, text_key)


def _reader_for(path: str):
    for ext, reader in ((".jsonl", _read_jsonl), (".txt", _read_text), (".parquet", _read_parquet)):
        if path.endswith(ext):
            return reader
    return None


def _read_jsonl(path: str, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if text_key not in row:
                raise KeyError(f"{path}:{line_no}: no key {text_key!r} (set data.text_key)")
            yield row[text_key]


def _read_text(path: str, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        doc: list[str] = []
        for line in f:
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
    table = pq.read_table(path, columns=[text_key])
    yield from table.column(text_key).to_pylist()
