"""Run logging: a progress bar, a JSONL metrics file, TensorBoard when installed."""

from __future__ import annotations

import json
import os
import time

from tqdm import tqdm


class MetricsLogger:
    """Only the logging rank writes; every other rank gets a no-op logger."""

    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        # A resumed run continues its file; a fresh run starts a new one.
        self._file = open(self.path, "a" if start_step > 0 else "w", encoding="utf-8")  # noqa: SIM115
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                         disable=None)  # None: off when stderr is not a terminal (CI logs)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self._tb = None
        self._t_start = time.time()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self._t_start, 3), **metrics}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}",
                              lr=f"{metrics.get('lr', 0.0):.2e}")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
