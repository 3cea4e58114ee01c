"""Host and device memory per rank, gathered into one JSON report (startup.json, export.json).

Why reports at all: a 70B or 235B start, or its export, fails by running a host out of memory,
so users want each rank's peak next to the model's size, and the tests read the same numbers.

Host peak is the kernel's high-water mark of this process's resident memory: ``VmHWM`` where
/proc exists (Linux), else ``ru_maxrss``. Why not ``ru_maxrss`` alone: Linux carries it over from
the parent across fork + exec, so a rank started by a large launcher (a test runner, a notebook)
reports the launcher's size. Both are recorded. /proc/self/clear_refs restarts ``VmHWM`` to
measure one phase (an export) alone.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
import torch.distributed as dist


def ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_host_bytes() -> int:
    """This process's peak resident memory since it started, or since ``reset_peak_host_bytes``."""
    hwm = _proc_status_kib("VmHWM")
    return ru_maxrss_bytes() if hwm is None else hwm * 1024


def current_host_bytes() -> int | None:
    rss = _proc_status_kib("VmRSS")
    return None if rss is None else rss * 1024


def reset_peak_host_bytes() -> bool:
    """Restart the high-water mark at the current resident size; False where the OS cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def gather_rank_figures(figures: dict[str, float | None], device: torch.device) -> list[dict]:
    """Every rank's ``figures`` (same keys on every rank), on every rank; one small collective."""
    keys = sorted(figures)
    mine = torch.tensor([float("nan") if figures[k] is None else float(figures[k]) for k in keys],
                        dtype=torch.float64, device=device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = [mine]
    if world > 1:
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
    table = torch.stack(rows).cpu().tolist()  # start-up / export only: never in the training step
    out = []
    for rank, values in enumerate(table):
        row = {"rank": rank}
        for key, value in zip(keys, values):
            row[key] = None if value != value else (int(value) if key.endswith("bytes") else round(value, 3))
        out.append(row)
    return out


def write_json_atomic(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def device_peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory since start, where its tensors live: the CUDA caching allocator's on a
    GPU, the process's peak resident memory on CPU. Host counters: reading them waits for no kernel."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_host_bytes()


def memory_summary(what: str, ranks: list[dict], model_bytes: int, seconds_key: str = "seconds") -> str:
    """One line for the log: time, each rank's host peak range against the model's bytes."""
    peaks = [r["peak_host_bytes"] for r in ranks]
    gib = 2**30
    line = (f"{what}: {max(r[seconds_key] for r in ranks):.1f} s, peak host memory per rank "
            f"{min(peaks) / gib:.2f}-{max(peaks) / gib:.2f} GiB (model {model_bytes / gib:.2f} GiB in fp32)")
    device = [r.get("device_peak_bytes") for r in ranks if r.get("device_peak_bytes") is not None]
    if device:
        line += f", device peak {max(device) / gib:.2f} GiB"
    return line


def report_startup(output_dir: str, device: torch.device, seconds: float, model_parameters: int,
                   trainable_parameters: int, weights_from: str) -> dict:
    """startup.json in ``output_dir`` (written by rank 0; a collective): each rank's peak host memory,
    device peak and seconds, with the model's parameters, those the optimizer updates (fewer under
    LoRA: the adapters) and the model's fp32 bytes; one line in the log too."""
    ranks = gather_rank_figures({"peak_host_bytes": peak_host_bytes(), "ru_maxrss_bytes": ru_maxrss_bytes(),
                                 "seconds": seconds, "device_peak_bytes": device_peak_bytes(device)}, device)
    model_bytes = 4 * model_parameters  # fp32 master weights
    report = {"model_parameters": model_parameters, "trainable_parameters": trainable_parameters,
              "model_bytes": model_bytes,
              "world_size": len(ranks), "device": device.type, "weights_from": weights_from, "ranks": ranks}
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = os.path.join(output_dir, "startup.json")
        write_json_atomic(path, report)
        print(memory_summary("start-up", ranks, model_bytes) + f"; {path}", flush=True)
    return report
