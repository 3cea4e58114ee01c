"""``python -m bench``: measure the device's peaks, run every bench/bench_<topic>.py, report.

Each module's ``run(ctx) -> list[Result]`` is called in turn; a module that raises (or fails to
import) is recorded as failed, with its traceback, and the run goes on. The table goes to stdout,
the JSON to ``<out>/<device-slug>-<UTC timestamp>.json`` (bench/results/ by default), with the
device (NVML clocks, power, memory where there is a GPU), software versions, git commit and dirty
flag, the measured peaks, and every Result's ``to_dict()`` tagged with its module.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from bench.context import BenchContext, Result
from bench.device_info import device_info, device_slug, git_state, software_versions
from bench.peaks import measure_peaks

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results"
SCHEMA_VERSION = 1


def discover(only: list[str] | None = None) -> list[str]:
    """Module names ``bench.bench_<topic>``; ``only`` keeps the ones whose topic or name is listed."""
    topics = sorted(p.stem[len("bench_") :] for p in BENCH_DIR.glob("bench_*.py"))
    if not only:
        return [f"bench.bench_{t}" for t in topics]
    wanted = {name.removeprefix("bench.").removeprefix("bench_").removesuffix(".py") for name in only}
    unknown = sorted(wanted - set(topics))
    if unknown:
        raise SystemExit(f"--only: no benchmark named {unknown}; available: {', '.join(topics)}")
    return [f"bench.bench_{t}" for t in topics if t in wanted]


def run_module(module_name: str, ctx: BenchContext) -> tuple[list[Result], dict[str, Any] | None]:
    """(results, failure or None); never raises."""
    start = time.perf_counter()
    try:
        module = importlib.import_module(module_name)
        results = list(module.run(ctx))
        for r in results:
            if not isinstance(r, Result):
                raise TypeError(
                    f"{module_name}.run returned a {type(r).__name__}, expected bench.context.Result"
                )
        return results, None
    except Exception as err:  # a failing benchmark is reported, the others still run
        return [], {
            "module": module_name,
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
            "seconds": time.perf_counter() - start,
        }
    finally:
        if ctx.on_gpu:  # release the module's memory before the next one; a sticky error surfaces there
            try:
                torch.cuda.synchronize(ctx.device)
                torch.cuda.empty_cache()
            except RuntimeError:
                pass


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"


def format_table(results: list[dict[str, Any]], failures: list[dict[str, Any]]) -> str:
    header = ["benchmark", "value", "unit", "anchor", "anchor value", "ratio", "peak frac"]
    rows = [
        [
            r["name"],
            _fmt(r["value"]),
            r["unit"],
            r["anchor"],
            _fmt(r["anchor_value"]),
            _fmt(r["ratio"]) + ("" if r["higher_is_better"] else " (lower better)"),
            _fmt(r["peak_fraction"], 2),
        ]
        for r in results
    ]
    rows += [[f["module"], "FAILED", "", f["error"][:80], "", "", ""] for f in failures]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings rather than emit invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # torch.dtype, torch.Size, ...


def run(
    device: torch.device, quick: bool, only: list[str] | None, out_dir: Path
) -> tuple[Path, dict[str, Any]]:
    modules = discover(only)
    started = datetime.now(timezone.utc)
    print(
        f"bench: {device_slug(device)} ({'quick' if quick else 'full'} sizes), modules: {', '.join(modules)}"
    )
    peaks = measure_peaks(device, quick)
    print(f"bench: peaks matmul {peaks['matmul_tflops']:.3g} TFLOP/s, copy {peaks['copy_gbps']:.4g} GB/s")
    ctx = BenchContext(device=device, peaks=peaks, quick=quick)
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for name in modules:
        t0 = time.perf_counter()
        module_results, failure = run_module(name, ctx)
        results += [{"module": name, **r.to_dict()} for r in module_results]
        if failure is not None:
            failures.append(failure)
            print(f"bench: {name} FAILED: {failure['error']}", file=sys.stderr)
        else:
            print(f"bench: {name}: {len(module_results)} results in {time.perf_counter() - t0:.1f}s")
    print(format_table(results, failures))
    payload = {
        "schema": SCHEMA_VERSION,
        "created_utc": started.isoformat(),
        "quick": quick,
        "device": device_info(device),
        "software": software_versions(),
        "git": git_state(),
        "peaks": peaks,
        "modules": modules,
        "results": results,
        "failures": failures,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{device_slug(device)}-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(payload), indent=2) + "\n")
    tmp.replace(path)  # never leave a half-written results file
    print(f"bench: wrote {path}")
    return path, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (always on without a GPU)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (e.g. copy moe)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    quick = args.quick or device.type != "cuda"
    _, payload = run(device, quick, args.only, args.out)
    return 1 if payload["failures"] else 0
