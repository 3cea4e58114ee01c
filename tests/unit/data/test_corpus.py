"""Reading documents (xorl/data/corpus.py): a parquet file's errors are one line."""

from __future__ import annotations

import pytest


def test_parquet_errors_are_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from xorl.data.corpus import DataError, read_documents

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"content": ["a", "b"], "n": [1, 2]}), path)
    with pytest.raises(DataError) as info:
        list(read_documents(str(path), "text"))
    assert str(info.value) == f"{path}: no column 'text' (columns: ['content', 'n']); set data.text_key"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError) as info:
        list(read_documents(str(path), "text"))
    assert str(info.value).startswith(f"{path}: cannot read column 'text': ") and "\n" not in str(info.value)
