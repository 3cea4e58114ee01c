"""Helpers of the fault tests that run the real command line (tests/e2e): a job read line by line as it
runs, a streamed-data run folder, a hook every torchrun worker runs first, and a transformers
Llama folder of tiny_config's shape (optionally with a NaN planted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.cli_runs import children, env, write_config


class Job:
    """A command whose output lines are read as they come, with the time each arrived."""

    def __init__(self, cmd: list[str], cwd, extra_env: dict | None = None):
        self.proc = subprocess.Popen(cmd, cwd=cwd, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def text(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def wait_for(self, prefix: str, limit_s: float = 300) -> float:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if line.startswith(prefix):
                    return t
            assert self.proc.poll() is None or self._reader.is_alive(), self.text
            time.sleep(0.05)
        raise AssertionError(f"no line starting with {prefix!r} within {limit_s} s:\n{self.text}")

    def finish(self, limit_s: float) -> int:
        """Wait for the exit; kill everything left (the job and its workers) if it takes longer."""
        try:
            self.proc.wait(timeout=limit_s)
            self.ended = time.monotonic()
        except subprocess.TimeoutExpired:
            for pid in children(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError(f"still running after {limit_s} s:\n{self.text}") from None
        finally:
            self._reader.join(timeout=10)
        return self.proc.returncode


def stream_config(tmp_path, rows: int, bad_at: int | None, **train) -> str:
    lines = [json.dumps({"text": f"document {i}: a few words to pack into sequences"}) for i in range(rows)]
    if bad_at is not None:
        lines.insert(bad_at, '{"text": "broken", oops}')
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path, "out", **train)
    text = (tmp_path / "run.yaml").read_text().replace("data:\n", "data:\n  streaming: true\n  dataset: data.jsonl\n")
    (tmp_path / "run.yaml").write_text(text)
    return config


def worker_hook(tmp_path, source: str) -> dict:
    """The environment that makes every torchrun worker run ``source`` first (a sitecustomize.py)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def seconds_after_last_step(job) -> float:
    return job.ended - max(t for t, line in job.lines if line.startswith("step "))


def hf_llama_folder(folder, nan_in: str | None = None, layers: int = 4) -> None:
    """A transformers Llama of tiny_config's shape (tests/support/cli_runs.py's: 2 layers); ``nan_in``: one NaN
    planted in that tensor."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                  max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf).save_pretrained(folder)
    if nan_in is not None:
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        tensors[nan_in][1, 2] = float("nan")
        save_file(tensors, path, metadata={"format": "pt"})
