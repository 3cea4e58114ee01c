"""Run the real command line the way a user does: `xorl-train`, `torchrun -m xorl.cli.train`,
`bash scripts/train.sh`, with stdout/stderr captured (so not a terminal) and a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import yaml

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
BIN = os.path.dirname(sys.executable)

TINY = {
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2},
    "data": {"seq_len": 32, "micro_batch_size": 1},
    "train": {"max_steps": 4, "warmup_steps": 1, "lr": 1.0e-2, "save_steps": 2, "log_steps": 1},
}


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def write_config(folder, output_dir: str, **train) -> str:
    config = {section: dict(values) for section, values in TINY.items()}
    config["train"].update(output_dir=output_dir, **train)
    path = os.path.join(folder, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def xorl_train(*args: str, cwd, timeout: float = 300) -> Result:
    """The console script, one process (no torchrun)."""
    proc = subprocess.run([os.path.join(BIN, "xorl-train"), *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def torchrun_command(nproc: int, *args: str) -> list[str]:
    return [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "-m", "xorl.cli.train",
            *args]


def torchrun(nproc: int, *args: str, cwd, timeout: float = 400) -> Result:
    proc = subprocess.run(torchrun_command(nproc, *args), cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except OSError:
        pass
    return None
