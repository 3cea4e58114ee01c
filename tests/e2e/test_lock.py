"""One run per output_dir (xorl/run/lock.py) through the real `xorl-train`: a second run into the same
folder is refused, and a dead holder does not block the next one."""

from __future__ import annotations

import os

import pytest

from tests.support.cli_runs import BIN, write_config, xorl_train
from tests.support.fault_runs import Job
from xorl.observability.metrics import read_metrics

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for process ids")


@pytest.mark.slow
def test_a_second_run_into_the_same_folder_is_refused_and_a_dead_holder_does_not_block(tmp_path):
    config = write_config(tmp_path, "out", max_steps=100_000, save_steps=2)
    first = Job([os.path.join(BIN, "xorl-train"), config], tmp_path)
    try:
        first.wait_for("step 3/")
        second = xorl_train(config, "--train.resume=true", cwd=tmp_path, timeout=120)
        assert second.code == 2 and "Traceback" not in second.text, second.text
        assert second.err.count("train.output_dir='out' is in use by another run") == 1, second.err
        assert f"pid {first.proc.pid} on host" in second.err
        assert first.proc.poll() is None  # the first run goes on
    finally:
        first.proc.kill()  # a dead holder: its lock goes with it
        first.finish(limit_s=60)
    assert len(read_metrics(tmp_path / "out" / "metrics.jsonl")) >= 3
    third = xorl_train(config, "--train.resume=true", "--train.max_steps=8", "--train.resume_hparams=config",
                       cwd=tmp_path, timeout=300)
    assert third.code == 0 and "in use by another run" not in third.text, third.text
