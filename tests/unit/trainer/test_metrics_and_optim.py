"""Metrics file, its plot, the learning-rate schedule and the AdamW implementation choice."""

import io
import json
import math
import sys

import pytest
import torch

from xorl.cli.plot_metrics import main as plot_main
from xorl.observability.metrics import MetricsLogger, read_metrics
from xorl.trainer.optim import lr_factor


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
    rows = [{"step": s, "time": 2.0 * s, "loss": 1.0} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "ti')  # cut short by a kill
    logger = MetricsLogger(str(tmp_path), total_steps=8, start_step=3, time_offset=10.0)
    logger.log(3, {"loss": 0.5, "lr": 1e-3})  # the 4th step (index 3), after checkpoint step_00000003
    logger.note("xorl: saved checkpoint somewhere")
    logger.close()
    got = read_metrics(str(path))
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # counted from 1, as the console and checkpoints
    assert got[:3] == rows[:3] and got[3]["time"] >= 10.0
    out = capsys.readouterr().out  # stderr is not a terminal here: plain lines, no bar
    assert "step 4/8 loss 0.5000 lr 1.00e-03 time 10." in out and "xorl: saved checkpoint somewhere" in out


def _adamw_config():
    from xorl.config import TrainConfig

    return TrainConfig(lr=1e-2, weight_decay=0.1)


def test_adamw_is_foreach_on_cpu():
    from xorl.trainer.optim import build_optimizer

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer, _ = build_optimizer(params, _adamw_config())
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


@pytest.mark.gpu
def test_adamw_is_fused_on_cuda_and_matches_foreach():
    from xorl.trainer.optim import build_optimizer

    torch.manual_seed(0)
    init = [torch.randn(64, 33), torch.randn(33)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    results = []
    for device in ("cuda", "cpu"):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        optimizer, _ = build_optimizer(params, _adamw_config())
        assert bool(optimizer.defaults["fused"]) == (device == "cuda")
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.to(device)
            optimizer.step()
        results.append([p.detach().cpu() for p in params])
    for a, b in zip(*results):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_a_resumed_tensorboard_sink_replaces_the_steps_after_its_checkpoint(tmp_path):
    # A run logged steps 1-4 and was resumed from checkpoint step_00000002: TensorBoard must show
    # steps 1-2 of the first run and 3-4 of the resumed one, as metrics.jsonl keeps them.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from xorl.observability.sinks import TensorBoardSink

    first = TensorBoardSink(str(tmp_path), start_step=0)
    for step in (1, 2, 3, 4):
        first.log(step, {"loss": float(step)})
    first.close()
    resumed = TensorBoardSink(str(tmp_path), start_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
