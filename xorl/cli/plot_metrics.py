"""`xorl-plot-metrics RUN_DIR [--out loss.png] [--keys loss grad_norm]`: plot a run's metrics to PNG.

RUN_DIR is a run folder (its metrics.jsonl is read) or a metrics.jsonl file. The x axis counts
steps from 1, as the console does. A run with validation (train.eval_steps) also has eval_loss on
its eval steps, drawn as points on the loss panel (and plotted alone with --keys eval_loss). The
default PNG is RUN_DIR/metrics.png, which xorl counts as its own file (overwrite_output_dir removes
it with the rest of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from xorl.run.folder import METRICS_NAME, PLOT_NAME

DEFAULT_KEYS = ["loss", "grad_norm", "lr"]
NOT_PLOTTED = ("step", "time")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="xorl-plot-metrics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="a run folder (train.output_dir) or its metrics.jsonl")
    parser.add_argument("--out", default=None, help=f"PNG path (default: {PLOT_NAME} beside the metrics file)")
    parser.add_argument("--keys", nargs="+", default=None, help=f"metrics to plot (default: {DEFAULT_KEYS})")
    args = parser.parse_args(argv)
    path = os.path.join(args.metrics, METRICS_NAME) if os.path.isdir(args.metrics) else args.metrics
    rows = _read_rows(path)
    known = sorted({k for r in rows for k in r if k not in NOT_PLOTTED})
    if args.keys is None:
        keys = [k for k in DEFAULT_KEYS if k in known]
    else:
        unknown = [k for k in args.keys if k not in known]
        if unknown:
            _fail(f"{path} has no metric {', '.join(map(repr, unknown))}; its metrics are {known}")
        keys = args.keys
    if not keys:
        _fail(f"{path} holds no rows to plot" if not rows else f"{path} has none of {DEFAULT_KEYS}; use --keys "
              f"with some of {known}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fail("plotting needs matplotlib: pip install matplotlib", code=1)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.5 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        # a null (MFU where the peak FLOP/s is unknown) is not a point
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
        evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r] if key == "loss" else []
        if evals:  # the validation curve beside the training loss, on the steps it was measured
            ax.plot([p[0] for p in evals], [p[1] for p in evals], "o-", label="eval_loss")
            ax.legend()
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    out = args.out or os.path.join(os.path.dirname(path), PLOT_NAME)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


def _read_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl; a line cut short by a kill is skipped, anything else is named."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        _fail(f"{path} does not exist; pass a run folder (train.output_dir) or its {METRICS_NAME}")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):  # the last line of a run that was killed while writing it
                continue
            _fail(f"{path}:{number}: not a JSON row; is this a metrics.jsonl written by xorl-train?")
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            _fail(f"{path}:{number}: not a row with a step; is this a metrics.jsonl written by xorl-train?")
        rows.append(row)
    return rows


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"xorl-plot-metrics: {message}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
