"""What a results file records about where it was measured: device, clocks, software, commit.

GPU clocks, power and memory come from NVML (nvidia-ml-py, the ``bench`` extra); every NVML
call is guarded, so a missing library or an unsupported query leaves a field out instead of
failing the run.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def device_slug(device: torch.device) -> str:
    """File-name-safe device name, e.g. 'nvidia-h100-80gb-hbm3' or 'cpu-x86_64'."""
    name = device_name(device).lower()
    if device.type != "cuda":
        name = f"cpu-{name}"
    return re.sub(r"[^a-z0-9_]+", "-", name).strip("-") or "device"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_state() -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def software_versions() -> dict[str, Any]:
    versions: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    try:
        from xorl_kernels.cuda_ext import _C

        versions["xorl_cuda_ext_runtime"] = None if _C is None else _C.cuda_runtime_version()
    except ImportError:
        versions["xorl_cuda_ext_runtime"] = None
    return versions


def _nvml_info(device: torch.device) -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"nvml": "nvidia-ml-py not installed (pip install nvidia-ml-py)"}
    info: dict[str, Any] = {}
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVML missing or no driver: record why
        return {"nvml": f"unavailable: {err}"}
    try:
        handle = _nvml_handle(pynvml, device)
        queries = {
            "driver_version": lambda: pynvml.nvmlSystemGetDriverVersion(),
            "sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "mem_clock_max_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "power_draw_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
            "power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
            "memory_total_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total,
            "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        }
        for key, query in queries.items():
            try:
                value = query()
                info[key] = value.decode() if isinstance(value, bytes) else value
            except Exception:  # an unsupported query (MIG, old driver) is left out
                pass
    except Exception as err:
        info["nvml"] = f"unavailable: {err}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return info


def _nvml_handle(pynvml, device: torch.device):
    """NVML's handle for the torch device: by PCI bus id when torch knows it (CUDA_VISIBLE_DEVICES
    renumbers devices for torch but not for NVML), else by index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus_id = getattr(props, "pci_bus_id", None)
    domain = getattr(props, "pci_domain_id", 0)
    device_id = getattr(props, "pci_device_id", None)
    if bus_id is not None and device_id is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus_id:02x}:{device_id:02x}.0")
        except Exception:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"name": device_name(device), "type": device.type, "slug": device_slug(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_bytes=props.total_memory,
        )
        info.update(_nvml_info(device))
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info
