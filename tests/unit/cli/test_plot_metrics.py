"""xorl/cli/plot_metrics.py in this process: the x axis is each row's step."""

from __future__ import annotations

import json

import pytest


def test_plot_metrics_x_axis_is_the_rows_step(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from xorl.cli import plot_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 + s}) + "\n"
                                                    for s in range(1, 4)))
    plotted = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **k: (plotted.append(list(x)),
                                                                                     original(self, x, y, *a, **k)))
    plot_metrics.main([str(tmp_path), "--keys", "loss"])
    assert plotted == [[1, 2, 3]]  # row 1 (the console's "step 1/3") is the first point
