"""`xorl-plot-metrics` (xorl/cli/plot_metrics.py) as a user runs it: a run folder in, a PNG out, one
line for what it cannot plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xorl.config import load_config
from xorl.run.preflight import prepare_run


def _plot(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "xorl-plot-metrics"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_plot_metrics_reads_a_run_folder_and_refuses_what_it_cannot_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "out"
    run.mkdir()
    rows = [{"step": s, "time": s * 0.5, "loss": 3.0 - s, "lr": 1e-3} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    ok = _plot("out", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == os.path.join("out", "metrics.png"), ok.stderr
    assert (run / "metrics.png").stat().st_size > 0
    missing = _plot("nothere", cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == ("xorl-plot-metrics: nothere does not exist; pass a run folder "
                                      "(train.output_dir) or its metrics.jsonl")
    unknown = _plot("out", "--keys", "loss", "los", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "has no metric 'los'; its metrics are ['loss', 'lr']" in unknown.stderr

    # the plot is xorl's file: overwrite_output_dir removes it with the run
    (run / "config.yaml").write_text("{}\n")
    config = load_config(None, [f"--train.output_dir={run}", "--train.overwrite_output_dir=true"])
    assert prepare_run(config, 1).overwrite
