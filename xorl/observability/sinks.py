"""Where rank 0's metrics go besides metrics.jsonl and the console: TensorBoard and Weights & Biases.

Both come from the ``logging`` extra (``pip install -e .[logging]``); a config that asks for one
whose package is missing is refused before start-up, naming the extra (``missing_logging_packages``,
called by xorl/config/validate.py). A sink gets every row metrics.jsonl gets (every step), with every
numeric key in it, whatever code added it (loss, lr, tokens/s, MFU, eval metrics, ...), at the same
``step`` as metrics.jsonl (from 1: the optimizer steps done, as the console and checkpoint names count).

- ``train.tensorboard: true``: ``output_dir/tensorboard`` (torch's SummaryWriter). A resumed run
  purges the events the stopped run wrote after its checkpoint, as metrics.jsonl drops those rows.
- ``train.wandb_project``: a W&B run whose files live in ``output_dir/wandb`` (``wandb.init(dir=...)``),
  named ``train.wandb_run_name`` (default: output_dir's folder name), with the whole config.
  ``train.wandb_mode: offline`` (or ``WANDB_MODE=offline`` when the field is unset) writes the run
  there only; ``wandb sync output_dir/wandb/offline-run-*`` uploads it later. Each start of a run
  (a resume) is a W&B run of its own, logging from its first step on: W&B cannot take back the
  points the stopped run logged after its checkpoint, so continuing that W&B run would keep them.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

from xorl.config.errors import ConfigError
from xorl.run.folder import TENSORBOARD_DIR, WANDB_DIR

LOGGING_EXTRA = "pip install -e .[logging]"  # pyproject.toml: logging = ["wandb", "tensorboard"]


def missing_logging_packages(train: Any) -> list[str]:
    """One problem per sink the config asks for whose package is not installed (no import: a second)."""
    problems = []
    for wanted, package, field in ((train.wandb_project is not None, "wandb", "wandb_project"),
                                   (train.tensorboard, "tensorboard", "tensorboard")):
        if wanted and importlib.util.find_spec(package) is None:
            problems.append(f"train.{field} needs the {package} package, which is not installed; install the logging "
                            f"extra ({LOGGING_EXTRA}, or pip install {package}), or remove train.{field}")
    return problems


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries (a null MFU on CPU, a string, a NaN are left out)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardSink:
    def __init__(self, output_dir: str, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops the events the stopped run logged after the checkpoint (steps > start_step).
        purge = start_step + 1 if start_step else None
        self.writer = SummaryWriter(os.path.join(output_dir, TENSORBOARD_DIR), purge_step=purge)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, train: Any, config: dict[str, Any], start_step: int):
        import wandb

        name = train.wandb_run_name or os.path.basename(os.path.abspath(train.output_dir))
        try:
            self.run = wandb.init(project=train.wandb_project, name=name, dir=train.output_dir,
                                  mode=train.wandb_mode, config={**config, "start_step": start_step},
                                  reinit="create_new")
        except Exception as e:  # noqa: BLE001 - e.g. online without credentials: one clean message
            raise ConfigError(
                f"train.wandb_project={train.wandb_project!r}: W&B could not start a run ({type(e).__name__}: {e}); "
                "log in (`wandb login` or WANDB_API_KEY), or log offline with --train.wandb_mode=offline"
            ) from None
        self.dir = os.path.join(train.output_dir, WANDB_DIR)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        # The run's files are complete once wandb's service has written them: at the latest when this
        # process exits (wandb waits for it then); right after finish() they may not be yet.
        self.run.finish()


def open_sinks(train: Any, config: dict[str, Any], start_step: int) -> list:
    """The sinks ``train`` asks for (rank 0 calls this; the other ranks log nothing)."""
    sinks: list = []
    try:
        if train.tensorboard:
            sinks.append(TensorBoardSink(train.output_dir, start_step))
        if train.wandb_project is not None:
            sinks.append(WandbSink(train, config, start_step))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
