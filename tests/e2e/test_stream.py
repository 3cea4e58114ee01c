"""Streamed data (xorl/data/stream.py) through the real `xorl-train`: an empty file is refused up front."""

from __future__ import annotations

import os

import pytest

from tests.support.cli_runs import xorl_train
from tests.support.fault_runs import stream_config

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for process ids")


@pytest.mark.slow
@pytest.mark.parametrize("content", ["", "\n  \n\t\n"], ids=["empty", "blank lines"])
def test_streaming_an_empty_file_is_refused_up_front(tmp_path, content):
    config = stream_config(tmp_path, rows=0, bad_at=None, max_steps=2, save_steps=0, heartbeat_s=2)
    (tmp_path / "data.jsonl").write_text(content)
    run = xorl_train(config, cwd=tmp_path, timeout=120)
    assert run.code == 2, run.text
    assert "Traceback" not in run.text and "still running" not in run.text
    assert run.err.count("data.dataset='data.jsonl': data.jsonl holds no document") == 1, run.err
    assert "xorl: world size" not in run.text  # refused before start-up: no summary line
    assert not (tmp_path / "out").exists()  # refused before anything was written
