"""`xorl-plot-metrics RUN_DIR/metrics.jsonl [--out loss.png] [--keys loss grad_norm]`: plot to PNG."""

from __future__ import annotations

import argparse

from xorl.metrics import read_metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("metrics", help="a metrics.jsonl file written by xorl-train")
    parser.add_argument("--out", default=None, help="PNG path (default: next to the metrics file)")
    parser.add_argument("--keys", nargs="+", default=["loss", "grad_norm", "lr"])
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib") from err
    rows = read_metrics(args.metrics)
    keys = [k for k in args.keys if any(k in r for r in rows)]
    if not keys:
        raise SystemExit(f"none of {args.keys} is in {args.metrics}")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.5 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    out = args.out or args.metrics.rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main()
