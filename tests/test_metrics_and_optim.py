"""Metrics file, its plot, and the learning-rate schedule."""

import json
import math

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
