"""Metrics file, its plot, and the learning-rate schedule."""

import io
import json
import math
import sys

from xorl.cli.plot_metrics import main as plot_main
from xorl.metrics import MetricsLogger, read_metrics
from xorl.optim import lr_factor


def test_metrics_jsonl_round_trip_and_plot(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=3)
    for step, loss in enumerate([3.0, 2.5, 2.25]):
        logger.log(step, {"loss": loss, "grad_norm": 1.0 / (step + 1), "lr": 1e-3})
    logger.close()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["loss"] for r in rows] == [3.0, 2.5, 2.25]
    assert all(json.dumps(r) for r in rows)
    out = tmp_path / "plot.png"
    plot_main([str(tmp_path / "metrics.jsonl"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_schedule_warmup_then_cosine_to_min():
    # Independent expectation of linear warmup over 4 steps, then cosine from 1 to 0.1 over 6 steps.
    expected = [(s + 1) / 4 for s in range(4)]
    expected += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 6)) for s in range(4, 11)]
    got = [lr_factor(s, warmup_steps=4, max_steps=10, min_lr_ratio=0.1) for s in range(11)]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-12
    assert abs(got[-1] - 0.1) < 1e-12


def test_a_resumed_logger_keeps_each_step_once_and_time_cumulative(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal, even under pytest -s
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "time": 2.0 * s, "loss": 1.0} for s in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "ti')  # cut short by a kill
    logger = MetricsLogger(str(tmp_path), total_steps=8, start_step=3, time_offset=10.0)
    logger.log(3, {"loss": 0.5, "lr": 1e-3})
    logger.note("xorl: saved checkpoint somewhere")
    logger.close()
    got = read_metrics(str(path))
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert got[:3] == rows[:3] and got[3]["time"] >= 10.0
    out = capsys.readouterr().out  # stderr is not a terminal here: plain lines, no bar
    assert "step 4/8 loss 0.5000 lr 1.00e-03 time 10." in out and "xorl: saved checkpoint somewhere" in out
