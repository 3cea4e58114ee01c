"""``python -m bench``: the JSON a quick CPU run writes, and a failing benchmark not stopping the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from bench import runner
from bench.context import BenchContext, Result
from tests.support.paths import REPO

REPO = REPO


@pytest.mark.slow
def test_quick_copy_run_writes_complete_json(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, even on a GPU machine
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "copy", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    files = list(tmp_path.glob("cpu-*.json"))
    assert len(files) == 1, f"expected one results file, found {files}"
    data = json.loads(files[0].read_text())
    for key in ("device", "software", "git", "peaks", "results", "failures", "created_utc", "quick"):
        assert key in data, f"results JSON lacks {key!r}"
    assert data["quick"] is True and data["failures"] == []
    assert data["device"]["type"] == "cpu" and data["device"]["name"]
    for key in ("python", "torch", "triton"):
        assert key in data["software"]
    assert set(data["git"]) == {"commit", "dirty"}
    assert data["peaks"]["matmul_tflops"] > 0 and data["peaks"]["copy_gbps"] > 0
    [result] = data["results"]
    assert result["module"] == "bench.bench_copy"
    for key in ("name", "value", "unit", "anchor", "anchor_value", "ratio", "peak_fraction", "params"):
        assert key in result, f"result lacks {key!r}"
    assert math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert math.isclose(result["ratio"], result["value"] / result["anchor_value"])
    assert "copy_" in done.stdout and "ratio" in done.stdout  # the table


def _raising_run(ctx):
    raise RuntimeError("planted benchmark failure")


def test_failing_module_is_reported_and_the_rest_runs(monkeypatch):
    ctx = BenchContext(device=torch.device("cpu"), peaks={"copy_gbps": 1.0, "matmul_tflops": 1.0}, quick=True)
    broken = types.ModuleType("bench.bench_planted_failure")
    broken.run = _raising_run
    monkeypatch.setitem(sys.modules, "bench.bench_planted_failure", broken)
    results, failure = runner.run_module("bench.bench_planted_failure", ctx)
    assert results == [] and "planted benchmark failure" in failure["error"]
    assert "Traceback" in failure["traceback"]
    results, failure = runner.run_module("bench.bench_copy", ctx)
    assert failure is None and isinstance(results[0], Result)
    table = runner.format_table([{"module": "m", **results[0].to_dict()}], [{"module": "x", "error": "boom"}])
    assert "FAILED" in table and results[0].name in table


def test_only_rejects_unknown_names():
    assert runner.discover(["copy"]) == ["bench.bench_copy"]
    with pytest.raises(SystemExit, match="no benchmark named"):
        runner.discover(["no_such_benchmark"])
