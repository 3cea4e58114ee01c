"""Streamed data's errors (xorl/data/stream.py) name the file's line, also past a resumed offset."""

from __future__ import annotations

import pytest


def test_streaming_errors_name_the_line(tmp_path):
    from xorl.data.corpus import DataError
    from xorl.data.stream import _documents_from

    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three", oops}\n{"text": 4}\n')
    with pytest.raises(DataError, match=rf"^{path}:4: not valid JSON"):
        list(_documents_from(str(path), 0, "text", 0))
    path.write_text(path.read_text().replace(", oops", ""))
    resumed_at = len(b'{"text": "one"}\n\n{"text": "two"}\n')  # a checkpoint's stream offset
    with pytest.raises(DataError, match=rf"^{path}:5: 'text' is number"):
        list(_documents_from(str(path), resumed_at, "text", 0))
